//! The HTTP endpoints: `/metrics` (Prometheus text), `/healthz`, `/readyz`,
//! and `/status` (JSON: each destination's current failures and bodies
//! through S3, which `outbox-relay status` shows beside the table's counts).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::metrics::Metrics;

/// Serve `/metrics`, `/healthz`, `/readyz` and `/status` on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
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
                if m.is_ready() {
                    (StatusCode::OK, "ready\n".to_string())
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", m.unready_reason()))
                }
            }),
        )
        .with_state(metrics);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
