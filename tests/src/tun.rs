//! A tun device (tun mode, no packet information) in a lab namespace: a device without a
//! link-layer header, as wireguard, ipip, sit and gre devices are (link type ARPHRD_NONE).
//!
//! Writing a packet to the device's file descriptor is that packet arriving on the device: it
//! meets XDP, then the stack, exactly as a tunnel's decapsulated traffic does. The device is
//! not persistent, so it disappears when the guard closes its descriptor (and with its
//! namespace), even when a test fails.

use std::fs::{File, OpenOptions};
use std::io::{self, Write as _};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd as _;

use crate::netns::NetNs;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;

/// A tun device in a namespace, up, with 198.18.N.1/24 and 2001:db8:N::1/64.
#[derive(Debug)]
pub struct Tun {
    file: File,
    /// Interface name.
    pub name: String,
    /// The device's address (the destination of the lab's packets).
    pub ipv4: Ipv4Addr,
    pub ipv6: Ipv6Addr,
}

impl Tun {
    /// Creates `name` in `ns` with the addresses of pair index `n`, and lets it accept spoofed
    /// IPv4 sources (rp_filter off).
    ///
    /// # Panics
    ///
    /// If /dev/net/tun cannot be opened or the device configured.
    pub fn new(ns: &NetNs, name: &str, n: u8) -> Tun {
        assert!(name.len() < 16, "interface names have at most 15 bytes");
        // The device is created in the namespace of the thread that asks for it.
        let file = ns
            .enter(|| -> io::Result<File> {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open("/dev/net/tun")?;
                // struct ifreq: the name, then the flags (a short) at offset 16.
                let mut ifr = [0u8; 40];
                ifr[..name.len()].copy_from_slice(name.as_bytes());
                ifr[16..18].copy_from_slice(&(IFF_TUN | IFF_NO_PI).to_ne_bytes());
                // SAFETY: TUNSETIFF reads and writes the 40-byte ifreq, which outlives the call.
                if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) } != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(file)
            })
            .unwrap_or_else(|e| panic!("creating tun device {name} in {}: {e}", ns.name()));
        let t = Tun {
            file,
            name: name.to_string(),
            ipv4: Ipv4Addr::new(198, 18, n, 1),
            ipv6: Ipv6Addr::new(0x2001, 0xdb8, u16::from(n), 0, 0, 0, 0, 1),
        };
        ns.ip(&["addr", "add", &format!("{}/24", t.ipv4), "dev", name]);
        ns.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{}/64", t.ipv6),
            "dev",
            name,
            "nodad",
        ]);
        ns.ip(&["link", "set", name, "up"]);
        crate::link::disable_rp_filter(ns, name);
        t
    }

    /// Delivers one IP packet (no link-layer header) as received on the device.
    pub fn send(&mut self, packet: &[u8]) -> io::Result<()> {
        let n = self.file.write(packet)?;
        if n != packet.len() {
            return Err(io::Error::other(format!(
                "tun took {n} of {} bytes",
                packet.len()
            )));
        }
        Ok(())
    }

    /// [`Tun::send`] `count` times.
    ///
    /// # Panics
    ///
    /// If a write fails.
    pub fn send_n(&mut self, packet: &[u8], count: u64) {
        for i in 0..count {
            self.send(packet)
                .unwrap_or_else(|e| panic!("writing packet {i} to {}: {e}", self.name));
        }
    }
}

/// The IP packet inside an untagged Ethernet frame built by [`crate::packet::Frame`].
pub fn ip_packet(frame: &[u8]) -> Vec<u8> {
    assert!(
        frame.len() > 14 && matches!(u16::from_be_bytes([frame[12], frame[13]]), 0x0800 | 0x86dd),
        "not an untagged IP frame"
    );
    frame[14..].to_vec()
}
