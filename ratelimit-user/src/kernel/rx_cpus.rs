//! The receive CPUs: the CPUs that take the attached interfaces' receive work, whose kernel
//! time is what `cpu_busy` watches when `pressure.cpus` does not name them (see
//! the pressure module).
//!
//! An interface's receive work runs where its interrupts are delivered (each IRQ of its
//! device: the MSI/MSI-X vectors in `/sys/class/net/<if>/device/msi_irqs`, or the legacy
//! `device/irq`, each delivered to `/proc/irq/<n>/effective_affinity_list`, else
//! `smp_affinity_list`), plus the CPUs RPS steers its packets to (`queues/rx-*/rps_cpus`).
//! A virtual interface (veth, a bridge) has no device interrupts: its receive work runs on
//! whichever CPU sends, so it has no receive CPUs of its own and every CPU is watched; so it
//! is when any interface's set cannot be read. The set is read again every [`REFRESH`]
//! (irqbalance moves interrupts).

use std::{
    collections::BTreeSet,
    path::Path,
    time::{Duration, Instant},
};

/// How often the receive CPUs are read again.
pub const REFRESH: Duration = Duration::from_secs(10);

/// `0-3,5,8-9` (a kernel CPU list) as CPU numbers; `None` if it does not parse.
pub fn parse_cpu_list(text: &str) -> Option<BTreeSet<u32>> {
    let mut cpus = BTreeSet::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.parse().ok()?, b.parse().ok()?);
                if b < a || b > crate::config::MAX_CPU {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => {
                let n: u32 = part.parse().ok()?;
                if n > crate::config::MAX_CPU {
                    return None;
                }
                cpus.insert(n);
            }
        }
    }
    Some(cpus)
}

/// `00000000,0000000f` (a kernel CPU mask: hex words, most significant first) as CPU numbers;
/// `None` if it does not parse.
pub fn parse_cpu_mask(text: &str) -> Option<BTreeSet<u32>> {
    let mut cpus = BTreeSet::new();
    let words: Vec<&str> = text.trim().split(',').collect();
    for (i, w) in words.iter().rev().enumerate() {
        let v = u32::from_str_radix(w, 16).ok()?;
        for bit in 0..32 {
            if v & (1 << bit) != 0 {
                let n = i as u32 * 32 + bit;
                if n > crate::config::MAX_CPU {
                    return None;
                }
                cpus.insert(n);
            }
        }
    }
    Some(cpus)
}

/// The receive CPUs of `iface` under the file system root `root` (`/`, or a test's copy):
/// `None` if it has no device interrupts (a virtual interface) or they cannot be read.
pub fn of_interface(root: &Path, iface: &str) -> Option<BTreeSet<u32>> {
    let dev = root.join("sys/class/net").join(iface).join("device");
    let mut irqs: BTreeSet<u32> = std::fs::read_dir(dev.join("msi_irqs"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    if irqs.is_empty()
        && let Some(n) = std::fs::read_to_string(dev.join("irq"))
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
        && n != 0
    {
        irqs.insert(n);
    }
    if irqs.is_empty() {
        return None;
    }
    let mut cpus = BTreeSet::new();
    for irq in irqs {
        let dir = root.join("proc/irq").join(irq.to_string());
        let list = std::fs::read_to_string(dir.join("effective_affinity_list"))
            .ok()
            .and_then(|t| parse_cpu_list(&t))
            .filter(|c| !c.is_empty())
            .or_else(|| {
                std::fs::read_to_string(dir.join("smp_affinity_list"))
                    .ok()
                    .and_then(|t| parse_cpu_list(&t))
            })?;
        cpus.extend(list);
    }
    // RPS: the CPUs the receive queues hand packets on to.
    if let Ok(queues) = std::fs::read_dir(root.join("sys/class/net").join(iface).join("queues")) {
        for q in queues.filter_map(|e| e.ok()) {
            if !q.file_name().to_string_lossy().starts_with("rx-") {
                continue;
            }
            if let Some(mask) = std::fs::read_to_string(q.path().join("rps_cpus"))
                .ok()
                .and_then(|t| parse_cpu_mask(&t))
            {
                cpus.extend(mask);
            }
        }
    }
    (!cpus.is_empty()).then_some(cpus)
}

/// The receive CPUs of every interface in `ifaces`, ascending; empty (every CPU) if any of
/// them has none of its own or cannot be read, or if there is no interface.
pub fn of_interfaces(root: &Path, ifaces: &[String]) -> Vec<u32> {
    let mut all = BTreeSet::new();
    for iface in ifaces {
        match of_interface(root, iface) {
            Some(c) => all.extend(c),
            None => return Vec::new(),
        }
    }
    all.into_iter().collect()
}

/// The receive CPUs, read again every [`REFRESH`].
#[derive(Debug, Default)]
pub struct RxCpus {
    read_at: Option<Instant>,
    cpus: Vec<u32>,
}

impl RxCpus {
    /// The receive CPUs of `ifaces` (empty: every CPU), read at most every [`REFRESH`].
    pub fn get(&mut self, ifaces: &[String], now: Instant) -> &[u32] {
        if self
            .read_at
            .is_none_or(|at| now.saturating_duration_since(at) >= REFRESH)
        {
            self.cpus = of_interfaces(Path::new("/"), ifaces);
            self.read_at = Some(now);
        }
        &self.cpus
    }

    /// The receive CPUs as last read (empty: every CPU, or not read yet).
    pub fn cached(&self) -> &[u32] {
        &self.cpus
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_and_masks_parse() {
        assert_eq!(
            parse_cpu_list("0-3,5\n")
                .unwrap()
                .into_iter()
                .collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 5]
        );
        assert_eq!(parse_cpu_list("").unwrap().len(), 0);
        assert!(parse_cpu_list("3-1").is_none());
        assert!(parse_cpu_list("x").is_none());
        assert_eq!(
            parse_cpu_mask("00000001,00000006\n")
                .unwrap()
                .into_iter()
                .collect::<Vec<_>>(),
            vec![1, 2, 32]
        );
        assert_eq!(parse_cpu_mask("0").unwrap().len(), 0);
    }

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    #[test]
    fn a_nics_receive_cpus_are_its_interrupts_and_rps_cpus_and_a_veth_has_none() {
        let dir = std::env::temp_dir().join(format!("ratelimit-rx-cpus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let root = dir.as_path();
        // eth0: two MSI-X vectors on CPUs 2 and 3 (effective), RPS on CPU 5 for one queue.
        for irq in ["40", "41"] {
            write(
                root,
                &format!("sys/class/net/eth0/device/msi_irqs/{irq}"),
                "msix",
            );
        }
        write(root, "proc/irq/40/effective_affinity_list", "2\n");
        write(root, "proc/irq/40/smp_affinity_list", "0-7\n");
        write(root, "proc/irq/41/effective_affinity_list", "3\n");
        write(
            root,
            "sys/class/net/eth0/queues/rx-0/rps_cpus",
            "00000020\n",
        );
        write(
            root,
            "sys/class/net/eth0/queues/rx-1/rps_cpus",
            "00000000\n",
        );
        write(
            root,
            "sys/class/net/eth0/queues/tx-0/xps_cpus",
            "000000ff\n",
        );
        // eth1: a legacy interrupt, only its configured affinity readable.
        write(root, "sys/class/net/eth1/device/irq", "11\n");
        write(root, "proc/irq/11/smp_affinity_list", "6\n");
        // veth0: no device.
        std::fs::create_dir_all(root.join("sys/class/net/veth0")).unwrap();
        let ifs = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(of_interfaces(root, &ifs(&["eth0"])), vec![2, 3, 5]);
        assert_eq!(
            of_interfaces(root, &ifs(&["eth0", "eth1"])),
            vec![2, 3, 5, 6]
        );
        assert!(
            of_interfaces(root, &ifs(&["eth0", "veth0"])).is_empty(),
            "unknown: all"
        );
        assert!(of_interfaces(root, &ifs(&["nosuch"])).is_empty());
        assert!(of_interfaces(root, &[]).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
