//! A TCP proxy that holds every chunk of bytes a fixed delay before it
//! passes it on, each way: the network between a host and its object
//! store, on one machine (this VM has no `netem`). Chunks overlap in
//! flight, so the delay is latency, not a limit on throughput: a round
//! trip through it takes twice the one-way delay more.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

/// Arguments of `sqcow2-bench delay-proxy`.
#[derive(Debug, clap::Args)]
pub struct DelayProxyArgs {
    /// Round trip added, milliseconds (half of it each way).
    #[arg(long, default_value_t = 5.0)]
    rtt_ms: f64,
    /// Where to listen (port 0 picks one; the address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Where to pass the connections on.
    #[arg(long)]
    to: String,
}

/// Serves until killed; prints `listening=ADDR` once it accepts.
pub fn run_cli(args: &DelayProxyArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rtt_ms.is_finite() && args.rtt_ms >= 0.0,
        "--rtt-ms must be a number of milliseconds"
    );
    let one_way = Duration::from_secs_f64(args.rtt_ms / 2000.0);
    let listener =
        TcpListener::bind(&args.listen).with_context(|| format!("binding {}", args.listen))?;
    println!("listening={}", listener.local_addr()?);
    std::io::stdout().flush()?;
    serve(&listener, &args.to, one_way);
    Ok(())
}

/// What passed through a proxy: HTTP requests by their first bytes
/// (clients that wait for each answer before the next request, as the
/// store client does: one request per burst), and bytes answered.
#[derive(Debug, Default)]
pub struct Traffic {
    pub gets: AtomicU64,
    pub heads: AtomicU64,
    pub bytes_down: AtomicU64,
}

impl Traffic {
    /// GETs, HEADs and bytes answered so far.
    pub fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.gets.load(Ordering::Relaxed),
            self.heads.load(Ordering::Relaxed),
            self.bytes_down.load(Ordering::Relaxed),
        )
    }
}

/// A proxy in this process adding `rtt` to every round trip to `to`; its
/// address and what passes through it.
pub fn spawn(rtt: Duration, to: &str) -> anyhow::Result<(std::net::SocketAddr, Arc<Traffic>)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let traffic = Arc::new(Traffic::default());
    let (to, t) = (to.to_string(), traffic.clone());
    std::thread::Builder::new()
        .name("delay-proxy".into())
        .spawn(move || serve_counting(&listener, &to, rtt / 2, &t))?;
    Ok((addr, traffic))
}

/// Passes every connection `listener` accepts on to `to`.
fn serve(listener: &TcpListener, to: &str, one_way: Duration) {
    serve_counting(listener, to, one_way, &Arc::new(Traffic::default()));
}

fn serve_counting(listener: &TcpListener, to: &str, one_way: Duration, traffic: &Arc<Traffic>) {
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let to = to.to_string();
        let traffic = traffic.clone();
        std::thread::spawn(move || {
            if let Ok(upstream) = TcpStream::connect(&to) {
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                relay(client, upstream, one_way, &traffic);
            }
        });
    }
}

/// Both directions of one connection, each delayed by `one_way`.
fn relay(client: TcpStream, upstream: TcpStream, one_way: Duration, traffic: &Arc<Traffic>) {
    let pairs = [
        (client.try_clone(), upstream.try_clone(), true),
        (upstream.try_clone(), client.try_clone(), false),
    ];
    let mut threads = Vec::new();
    for (from, to, up) in pairs {
        let (Ok(from), Ok(to)) = (from, to) else {
            return;
        };
        let traffic = traffic.clone();
        threads.push(std::thread::spawn(move || {
            pump(from, to, one_way, &|chunk: &[u8]| {
                if up {
                    if chunk.starts_with(b"GET ") {
                        traffic.gets.fetch_add(1, Ordering::Relaxed);
                    } else if chunk.starts_with(b"HEAD ") {
                        traffic.heads.fetch_add(1, Ordering::Relaxed);
                    }
                } else {
                    traffic
                        .bytes_down
                        .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
            })
        }));
    }
    for t in threads {
        let _ = t.join();
    }
}

/// Reads chunks from `from` and has a writer pass each on to `to` once
/// it is `delay` old; the end of `from` is passed on last.
fn pump(mut from: TcpStream, to: TcpStream, delay: Duration, seen: &dyn Fn(&[u8])) {
    let (tx, rx) = channel::<(Instant, Vec<u8>)>();
    let writer = std::thread::spawn(move || deliver(rx, to));
    let mut buf = vec![0u8; 256 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                seen(&buf[..n]);
                if tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.join();
}

fn deliver(rx: Receiver<(Instant, Vec<u8>)>, mut to: TcpStream) {
    for (due, bytes) in rx {
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if to.write_all(&bytes).is_err() {
            return;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes through the proxy both ways, to an echo server and back,
    /// arrive whole and in order, and the ends pass through.
    #[test]
    fn bytes_pass_both_ways_whole_and_in_order() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let echo_addr = echo.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for c in echo.incoming() {
                let mut c = c.unwrap();
                std::thread::spawn(move || {
                    let mut r = c.try_clone().unwrap();
                    let _ = std::io::copy(&mut r, &mut c);
                    let _ = c.shutdown(Shutdown::Write);
                });
            }
        });
        let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
        let proxy_addr = proxy.local_addr().unwrap();
        std::thread::spawn(move || serve(&proxy, &echo_addr, Duration::from_millis(2)));
        let mut c = TcpStream::connect(proxy_addr).unwrap();
        let sent: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut w = c.try_clone().unwrap();
        let data = sent.clone();
        let writer = std::thread::spawn(move || {
            for chunk in data.chunks(100_003) {
                w.write_all(chunk).unwrap();
            }
            w.shutdown(Shutdown::Write).unwrap();
        });
        let mut back = Vec::new();
        c.read_to_end(&mut back).unwrap();
        writer.join().unwrap();
        assert!(back == sent, "{} bytes back of {}", back.len(), sent.len());
    }
}
