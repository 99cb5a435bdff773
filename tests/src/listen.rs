//! A listener whose accept queue overflows: the kernel counts TcpExt ListenDrops in the
//! caller's network namespace, the pressure level's listen signal.

/// A listening socket with a backlog of 1 that never accepts, and connections to it: the
/// accept queue overflows and the kernel counts TcpExt ListenDrops in this namespace.
pub struct Overflowing {
    _listener: libc::c_int,
    clients: Vec<libc::c_int>,
}

impl Drop for Overflowing {
    fn drop(&mut self) {
        for fd in self.clients.drain(..) {
            // SAFETY: fds opened by this test and closed once.
            unsafe { libc::close(fd) };
        }
        // SAFETY: as above.
        unsafe { libc::close(self._listener) };
    }
}

fn sockaddr(port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// Overflow a listener on 127.0.0.1:`port` with `n` non-blocking connects (in the caller's
/// network namespace).
pub fn overflow(port: u16, n: usize) -> Overflowing {
    let addr = sockaddr(port);
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on fds this function owns, with a valid address.
    unsafe {
        let l = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(l >= 0);
        let one: libc::c_int = 1;
        libc::setsockopt(
            l,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        assert_eq!(
            libc::bind(l, (&addr as *const libc::sockaddr_in).cast(), len),
            0,
            "bind: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(libc::listen(l, 1), 0);
        let mut clients = Vec::with_capacity(n);
        for _ in 0..n {
            let c = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0);
            assert!(c >= 0);
            libc::connect(c, (&addr as *const libc::sockaddr_in).cast(), len);
            clients.push(c);
        }
        Overflowing {
            _listener: l,
            clients,
        }
    }
}
