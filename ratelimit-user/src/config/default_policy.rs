//! The embedded default policy: what `ratelimit run` enforces without a config file, and what
//! `ratelimit check-config --print-default` prints to start a config from. It is made of the
//! ready rules of the example config, sized so that no ordinary client meets them:
//! - a per-client SYN `rate_based_ban` (a source opening more than 200 connections a second
//!   is throttled, one opening more than 1,000 a second banned for 10 minutes);
//! - the UDP reflection rule (large responses from the services attackers reflect off: one
//!   budget of 20,000 a second for all of them), with the host's own resolvers excepted;
//! - the out-of-state TCP rule (segments no local socket accepts: ACK, RST and FIN floods);
//! - a per-source backstop of 100,000 packets a second (a gigabit of full-size frames).

use std::net::IpAddr;

/// Where the host's resolvers are listed, and where systemd-resolved lists the upstream
/// servers behind its local stub (127.0.0.53).
pub const RESOLV_CONF: &str = "/etc/resolv.conf";
pub const RESOLVED_UPSTREAMS: &str = "/run/systemd/resolve/resolv.conf";

/// The source ports of the UDP services attackers reflect off: chargen, DNS, NTP, SNMP, CLDAP,
/// SSDP, WS-Discovery, mDNS, memcached.
pub const REFLECTION_PORTS: [u16; 9] = [19, 53, 123, 161, 389, 1900, 3702, 5353, 11211];

/// The `nameserver` addresses of resolv.conf text, without loopback ones (a query to a local
/// stub never crosses a NIC) and without repeats, in their order.
pub fn resolvers(resolv_conf: &str) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    for line in resolv_conf.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        // An IPv6 nameserver may carry a zone (`fe80::1%eth0`): the address is what a
        // response comes from.
        let Some(addr) = words
            .next()
            .and_then(|w| w.split('%').next())
            .and_then(|w| w.parse::<IpAddr>().ok())
        else {
            continue;
        };
        if !addr.is_loopback() && !addr.is_unspecified() && !out.contains(&addr) {
            out.push(addr);
        }
    }
    out
}

/// This host's resolvers: those of [`RESOLV_CONF`], and those behind a local stub
/// ([`RESOLVED_UPSTREAMS`]); files that cannot be read add none.
pub fn host_resolvers() -> Vec<IpAddr> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let mut all = resolvers(&read(RESOLV_CONF));
    for a in resolvers(&read(RESOLVED_UPSTREAMS)) {
        if !all.contains(&a) {
            all.push(a);
        }
    }
    all
}

/// The default policy as config text, `resolvers` excepted from the reflection rule.
pub fn default_policy(resolvers: &[IpAddr]) -> String {
    let ports: Vec<String> = REFLECTION_PORTS
        .iter()
        .map(|p| format!("\"{p}\""))
        .collect();
    let except = if resolvers.is_empty() {
        "# (no resolver found in /etc/resolv.conf: list the host's own resolvers here)\n\
         #~ except = [\"192.0.2.53/32\"]\n"
            .to_string()
    } else {
        let nets: Vec<String> = resolvers
            .iter()
            .map(|a| match a {
                IpAddr::V4(_) => format!("\"{a}/32\""),
                IpAddr::V6(_) => format!("\"{a}/128\""),
            })
            .collect();
        format!(
            "# The host's own resolvers (from /etc/resolv.conf): their responses never count.\n\
             except = [{}]\n",
            nets.join(", ")
        )
    };
    format!(
        r#"# ratelimit's default policy: what `ratelimit run` enforces without a config file.
# Printed by `ratelimit check-config --print-default`; the thresholds are generous, so that
# no ordinary client meets them.

[[rule]]
# A source opening connections faster than any client does: throttled above 200 SYNs a
# second, banned for 10 minutes above 1,000.
name = "syn-per-client"
match = {{ protocol = "tcp", tcp_flags = "syn" }}
key = "ip"
action = "rate_based_ban"
threshold = {{ count = 200, interval = "1s" }}
ban_threshold = {{ count = 1000, interval = "1s" }}
ban_duration = "10m"

[[rule]]
# UDP reflection and amplification: large responses from the services attackers reflect
# off, from many real reflectors each under any per-source threshold: one budget for all.
name = "udp-reflection"
match = {{ protocol = "udp", src_ports = [{ports}], length = ["400-65535"] }}
{except}key = "all"
action = "throttle"
threshold = {{ count = 20000, interval = "1s" }}

[[rule]]
# Out-of-state TCP: segments without SYN that no local socket accepts (ACK, RST and FIN
# floods), dropped before the kernel looks each one up and answers it with a reset.
name = "out-of-state-tcp"
match = {{ protocol = "tcp", tcp_flags = "!syn", tcp_state = "no_connection" }}
key = "all"
action = "throttle"
threshold = {{ count = 1, interval = "1s" }}

[[rule]]
# A backstop per source: 100,000 packets a second, a gigabit of full-size frames.
name = "per-source-backstop"
key = "ip"
action = "throttle"
threshold = {{ count = 100000, interval = "1s" }}
"#,
        ports = ports.join(", "),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolvers_are_read_from_nameserver_lines_without_loopback_or_repeats() {
        let text = "# a comment\nsearch lab.test\nnameserver 127.0.0.53\nnameserver 192.0.2.53\n\
                    nameserver  2001:db8::53 \nnameserver fe80::1%eth0\nnameserver 192.0.2.53\n\
                    nameserver ::1\nnameserver bogus\nnameserver\noptions edns0\n";
        let want: Vec<IpAddr> = ["192.0.2.53", "2001:db8::53", "fe80::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(resolvers(text), want);
        assert!(resolvers("").is_empty());
    }

    #[test]
    fn the_default_policy_is_a_valid_config_with_the_ready_rules() {
        let resolvers: Vec<IpAddr> = vec![
            "192.0.2.53".parse().unwrap(),
            "2001:db8::53".parse().unwrap(),
        ];
        let text = default_policy(&resolvers);
        let cfg = crate::config::parse("<default policy>", &text).unwrap();
        let names: Vec<&str> = cfg.rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "syn-per-client",
                "udp-reflection",
                "out-of-state-tcp",
                "per-source-backstop"
            ]
        );
        let refl = &cfg.rules[1];
        assert_eq!(refl.matcher.src_ports.len(), REFLECTION_PORTS.len());
        let except: Vec<String> = refl
            .matcher
            .except
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(except, ["192.0.2.53/32", "2001:db8::53/128"]);
        assert_eq!(
            cfg.rules[2].matcher.tcp_state,
            Some(crate::config::TcpState::NoConnection)
        );
        // Without a resolver the rule has no exception, and the text still parses.
        let cfg = crate::config::parse("<default policy>", &default_policy(&[])).unwrap();
        assert!(cfg.rules[1].matcher.except.is_empty());
        // Nothing else: the daemon's settings are the defaults.
        assert_eq!(cfg.daemon, crate::config::parse("x", "").unwrap().daemon);
    }
}
