//! A loopback port held for a test without listening on it.
//!
//! A server in the test's own process takes a bound listener (`TcpListener::bind("127.0.0.1:0")`, handed to
//! `serve`): it never needs this. A child process, though, is told a port in its configuration, and binding one,
//! releasing it and passing the number on is a race: any other bind of port 0 may take it in between. A
//! [`ReservedPort`] closes that race: a socket bound with `SO_REUSEADDR` and never listening keeps the kernel from
//! handing the port to a bind of port 0, while the child (whose listener sets `SO_REUSEADDR` too: tokio's, mio's,
//! asyncio's, PostgreSQL's) binds it explicitly and listens. Nothing listens on the reservation itself, so
//! connections to the port are refused while no server has it: a server can stop and start again on the same port,
//! and a port nobody serves is a peer that is down.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::os::fd::OwnedFd;

use rustix::net::{AddressFamily, SocketFlags, SocketType};

/// A loopback port reserved until dropped; see the module documentation.
#[derive(Debug)]
pub struct ReservedPort {
    _socket: OwnedFd,
    addr: SocketAddr,
}

impl ReservedPort {
    /// Reserves a free loopback port.
    pub fn new() -> Self {
        let (socket, addr) = reusable(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)).expect("a loopback port to reserve");
        Self { _socket: socket, addr }
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A listener on the reserved port, for a server in this process that stops and serves again on it (the
    /// reservation stays when the listener is dropped). Blocking, as std's are: a tokio listener wants
    /// `set_nonblocking(true)` first.
    pub fn listen(&self) -> TcpListener {
        let SocketAddr::V4(addr) = self.addr else { unreachable!("reservations are IPv4 loopback") };
        let (socket, _) = reusable(addr).expect("a listener on the reserved port");
        rustix::net::listen(&socket, 128).expect("listens on the reserved port");
        TcpListener::from(socket)
    }
}

impl Default for ReservedPort {
    fn default() -> Self {
        Self::new()
    }
}

/// A TCP socket with SO_REUSEADDR bound to `addr`, not listening, and the address it got.
fn reusable(addr: SocketAddrV4) -> std::io::Result<(OwnedFd, SocketAddr)> {
    let socket = rustix::net::socket_with(AddressFamily::INET, SocketType::STREAM, SocketFlags::CLOEXEC, None)?;
    rustix::net::sockopt::set_socket_reuseaddr(&socket, true)?;
    rustix::net::bind(&socket, &addr)?;
    let bound = SocketAddr::try_from(rustix::net::getsockname(&socket)?).map_err(std::io::Error::other)?;
    Ok((socket, bound))
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;
    use std::net::{TcpListener, TcpStream};

    use super::ReservedPort;

    #[test]
    fn a_reserved_port_refuses_connections_and_is_not_handed_to_binds_of_port_zero() {
        let reserved = ReservedPort::new();
        let refused = TcpStream::connect(reserved.addr()).expect_err("nothing listens");
        assert_eq!(refused.kind(), ErrorKind::ConnectionRefused);
        for _ in 0..2000 {
            let other = TcpListener::bind("127.0.0.1:0").expect("bind");
            assert_ne!(other.local_addr().expect("address"), reserved.addr());
        }
    }

    #[test]
    fn a_server_binds_the_reserved_port_stops_and_binds_it_again() {
        let reserved = ReservedPort::new();
        for _ in 0..2 {
            // As a child would: std's bind sets SO_REUSEADDR.
            let listener = TcpListener::bind(reserved.addr()).expect("binds the reserved port");
            TcpStream::connect(reserved.addr()).expect("accepted");
            drop(listener);
            let refused = TcpStream::connect(reserved.addr()).expect_err("stopped");
            assert_eq!(refused.kind(), ErrorKind::ConnectionRefused);
        }
        let listener = reserved.listen();
        assert_eq!(listener.local_addr().expect("address"), reserved.addr());
        TcpStream::connect(reserved.addr()).expect("accepted");
    }
}
