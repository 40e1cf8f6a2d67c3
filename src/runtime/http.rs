//! The HTTP endpoints: `/metrics` (Prometheus text); `/healthz` (the
//! process answers: liveness, asking neither PostgreSQL nor AWS); `/readyz`
//! (leading or polling and keeping up, or a standby able to take over:
//! readiness, which leadership does not decide); `/leader` (200 only on the
//! relay that holds the slot's leader lock); and `/status` (JSON: each
//! destination's current failures and bodies through S3, which
//! `outbox-relay status` shows beside the table's counts).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::metrics::Metrics;

/// Serve `/metrics`, `/healthz`, `/readyz`, `/leader` and `/status` on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use crate::metrics::Readiness;
    use axum::{extract::State, http::StatusCode, routing::get, Router};
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move {
                ([("content-type", "text/plain; version=0.0.4")], m.render())
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/status",
            get(|State(m): State<Arc<Metrics>>| async move {
                let body = serde_json::to_string(&m.lanes()).unwrap_or_else(|_| "[]".into());
                ([("content-type", "application/json")], body)
            }),
        )
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                match m.readiness() {
                    Readiness::Active => (StatusCode::OK, "ready\n".to_string()),
                    Readiness::Standby => (StatusCode::OK, "ready: standby, takes over when the leader goes\n".into()),
                    Readiness::NotReady(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")),
                }
            }),
        )
        .route(
            "/leader",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.is_leader.get() == 1 {
                    (StatusCode::OK, "leader\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not the leader\n")
                }
            }),
        )
        .with_state(metrics);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
