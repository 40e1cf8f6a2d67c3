FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin outbox-relay

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/outbox-relay /usr/local/bin/outbox-relay
# Not root: Kubernetes manifests run it as this user (deploy/kubernetes).
USER 65532:65532
ENTRYPOINT ["outbox-relay"]
