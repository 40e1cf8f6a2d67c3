//! A TCP proxy in front of a server, that a test can take down, hang and
//! bring back: down, it drops every open connection and refuses new ones (as
//! an endpoint that vanished); hung, it keeps every connection open and
//! passes nothing either way (as an endpoint that froze); up, it forwards
//! again.

use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A proxy on a free loopback port.
pub struct Proxy {
    pub url: String,
    up: watch::Sender<State>,
    task: tokio::task::JoinHandle<()>,
}

/// What the proxy does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Up,
    Down,
    Hung,
}

impl Proxy {
    /// Forward `127.0.0.1:<free port>` to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (up, rx) = watch::channel(State::Up);
        let upstream: Arc<str> = Arc::from(upstream);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                match *rx.borrow() {
                    State::Down => continue, // dropped: the connection is refused
                    State::Hung => {
                        tokio::spawn(hold(client, rx.clone()));
                        continue;
                    }
                    State::Up => {}
                }
                tokio::spawn(forward(client, Arc::clone(&upstream), rx.clone()));
            }
        });
        Proxy { url, up, task }
    }

    /// Down: open connections are cut, new ones closed at once.
    pub fn down(&self) {
        self.up.send_replace(State::Down);
    }

    /// Hung: every connection, open or new, is held open and silent.
    pub fn hang(&self) {
        self.up.send_replace(State::Hung);
    }

    pub fn up(&self) {
        self.up.send_replace(State::Up);
    }
}

/// A connection held open and silent until the proxy is up again (then
/// closed: what was asked on it was never answered).
async fn hold(client: TcpStream, mut state: watch::Receiver<State>) {
    let _ = state.wait_for(|s| *s != State::Hung).await;
    drop(client);
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(mut client: TcpStream, upstream: Arc<str>, mut state: watch::Receiver<State>) {
    let Ok(mut server) = TcpStream::connect(&*upstream).await else { return };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = state.wait_for(|s| *s != State::Up) => {}
    }
    // Hung: held open and silent, the server's end too.
    if *state.borrow() == State::Hung {
        hold(client, state).await;
    }
}
