//! `serve --metrics ADDR`: the statistics in the OpenMetrics text format
//! over HTTP, for a Prometheus scraper (`GET /metrics`; any other path is
//! 404, any other method 405). The same text as the control socket's
//! `stats` with `"format": "prometheus"`.

use std::sync::Arc;

use tracing::{info, warn};

use crate::daemon::exports::Exports;

/// The bound endpoint, not serving yet.
pub(crate) struct MetricsEndpoint(tiny_http::Server);

impl std::fmt::Debug for MetricsEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MetricsEndpoint")
            .field(&self.0.server_addr().to_ip())
            .finish()
    }
}

/// Binds `addr` (`HOST:PORT`; port 0 picks one, logged once serving).
pub(crate) fn bind(addr: &str) -> std::io::Result<MetricsEndpoint> {
    tiny_http::Server::http(addr)
        .map(MetricsEndpoint)
        .map_err(|e| std::io::Error::other(format!("metrics endpoint {addr}: {e}")))
}

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Answers scrapes on a thread of its own for the life of the process.
pub(crate) fn spawn(endpoint: MetricsEndpoint, exports: Arc<Exports>) -> std::io::Result<()> {
    let server = endpoint.0;
    if let Some(addr) = server.server_addr().to_ip() {
        info!(url = %format!("http://{addr}/metrics"), "metrics endpoint ready");
    }
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let response = match (request.method(), request.url()) {
                    (tiny_http::Method::Get, "/metrics") => {
                        let text = render(&exports);
                        let header = tiny_http::Header::from_bytes("Content-Type", CONTENT_TYPE)
                            .expect("a valid header");
                        tiny_http::Response::from_string(text).with_header(header)
                    }
                    (tiny_http::Method::Get, _) => {
                        tiny_http::Response::from_string("not found: GET /metrics\n")
                            .with_status_code(404)
                    }
                    _ => tiny_http::Response::from_string("method not allowed\n")
                        .with_status_code(405),
                };
                if let Err(e) = request.respond(response) {
                    warn!(error = %e, "metrics: could not answer a scrape");
                }
            }
        })
        .map(|_| ())
}

/// The metrics of every export: unlabelled while the daemon serves one
/// (as before it could serve several), labelled `export` otherwise.
fn render(exports: &Exports) -> String {
    let all = exports.all();
    match all.as_slice() {
        [(_, shared)] => {
            crate::daemon::control::prometheus::render(&crate::daemon::control::stats(shared))
        }
        _ => crate::daemon::control::prometheus::render_exports(
            &all.iter()
                .map(|(id, shared)| (id.clone(), crate::daemon::control::stats(shared)))
                .collect::<Vec<_>>(),
        ),
    }
}
