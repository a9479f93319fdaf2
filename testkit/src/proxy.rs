//! A TCP proxy on loopback whose traffic a test can hold, as a network
//! partition would: while held it reads nothing from either side, so what
//! the clients send waits in the kernel's buffers, and arrives when the
//! proxy lets it through again.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use crate::TestResult;

/// Forwards every connection made to its port to `upstream`, until dropped.
pub struct Proxy {
    port: u16,
    held: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    /// Listens on `port` of 127.0.0.1 and forwards to `upstream`.
    ///
    /// # Errors
    /// When the port cannot be bound.
    pub fn start(port: u16, upstream: SocketAddr) -> TestResult<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port))?;
        listener.set_nonblocking(true)?;
        let held = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (h, st) = (held.clone(), stop.clone());
        thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let Ok(server) = TcpStream::connect(upstream) else {
                            let _ = client.shutdown(Shutdown::Both);
                            continue;
                        };
                        for (from, to) in [(&client, &server), (&server, &client)] {
                            if let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) {
                                let (h, st) = (h.clone(), st.clone());
                                thread::spawn(move || pump(from, to, &h, &st));
                            }
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        thread::sleep(Duration::from_millis(10));
                    }
                    Err(_) => thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Ok(Self { port, held, stop })
    }

    /// The proxy's address, `127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Stops forwarding in both directions; nothing is lost.
    pub fn hold(&self) {
        self.held.store(true, Ordering::SeqCst);
    }

    /// Forwards again, what waited first.
    pub fn release(&self) {
        self.held.store(false, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.held.store(false, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` until either closes, reading nothing while held.
fn pump(mut from: TcpStream, mut to: TcpStream, held: &AtomicBool, stop: &AtomicBool) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        if held.load(Ordering::SeqCst) {
            thread::sleep(Duration::from_millis(5));
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
