//! What the DHCPv4 and DHCPv6 servers share: a UDP socket bound to one bridge, and the loop that
//! answers each datagram that arrives on it.

use std::net::SocketAddr;

use tracing::{debug, warn};

use crate::error::{NetworkError, Result};

/// A non-blocking UDP socket on `addr` bound to `interface`: one server per bridge, all on the
/// same port, each bound to its own device. IPv4 servers may broadcast (DHCPv4 clients have no
/// address yet); IPv6 servers take IPv6 only. `server` names the server in errors.
pub(crate) fn bridge_socket(
    server: &str,
    interface: &str,
    addr: SocketAddr,
) -> Result<tokio::net::UdpSocket> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, setsockopt, socket, sockopt,
    };
    let err = |what: &str| {
        let action = format!("{server} socket on {interface}: {what}");
        move |e: nix::Error| NetworkError::io(action)(e.into())
    };
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(
        family,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(err("socket"))?;
    setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(err("SO_REUSEADDR"))?;
    if addr.is_ipv4() {
        setsockopt(&fd, sockopt::Broadcast, &true).map_err(err("SO_BROADCAST"))?;
    } else {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true).map_err(err("IPV6_V6ONLY"))?;
    }
    setsockopt(&fd, sockopt::BindToDevice, &interface.into()).map_err(err("SO_BINDTODEVICE"))?;
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(addr),
    )
    .map_err(err(&format!("bind to port {}", addr.port())))?;
    tokio::net::UdpSocket::from_std(std::net::UdpSocket::from(fd))
        .map_err(NetworkError::io(format!("{server} socket on {interface}")))
}

/// Answers every datagram on `sock` with what `answer` makes of it (the reply and where it
/// goes), until the future is dropped. `answer` returns `None` for a datagram that gets no
/// reply; a failed receive or send is logged, never the end of the server.
pub(crate) async fn answer_forever(
    server: &'static str,
    interface: String,
    sock: tokio::net::UdpSocket,
    mut answer: impl FnMut(&[u8], SocketAddr) -> Option<(Vec<u8>, SocketAddr)>,
) {
    let mut buf = vec![0u8; 1500];
    loop {
        let (n, from) = match sock.recv_from(&mut buf).await {
            Ok(received) => received,
            Err(e) => {
                warn!(%interface, error = %e, "{server} receive failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some((reply, to)) = answer(&buf[..n], from) else {
            continue;
        };
        match sock.send_to(&reply, to).await {
            Ok(_) => debug!(%interface, %to, "{server} reply sent"),
            Err(e) => warn!(%interface, error = %e, "{server} send failed"),
        }
    }
}
