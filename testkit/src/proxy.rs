//! A TCP proxy in front of a server, that a test can take down and bring
//! back: down, it drops every open connection and refuses new ones (as an
//! endpoint that vanished); up, it forwards again.

use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A proxy on a free loopback port.
pub struct Proxy {
    pub url: String,
    up: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Forward `127.0.0.1:<free port>` to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (up, rx) = watch::channel(true);
        let upstream: Arc<str> = Arc::from(upstream);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if !*rx.borrow() {
                    continue; // dropped: the connection is refused
                }
                tokio::spawn(forward(client, Arc::clone(&upstream), rx.clone()));
            }
        });
        Proxy { url, up, task }
    }

    /// Down: open connections are cut, new ones closed at once.
    pub fn down(&self) {
        self.up.send_replace(false);
    }

    pub fn up(&self) {
        self.up.send_replace(true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(mut client: TcpStream, upstream: Arc<str>, mut up: watch::Receiver<bool>) {
    let Ok(mut server) = TcpStream::connect(&*upstream).await else { return };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = up.wait_for(|u| !*u) => {}
    }
}
