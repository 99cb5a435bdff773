//! Loading the object against the pinned maps (or creating them), the placement hash's key,
//! and running the program on test frames (BPF_PROG_TEST_RUN).

use std::path::Path;

use anyhow::{Context as _, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData},
    programs::Xdp,
};
use ratelimit_common::maps::{HASH_KEY_WORDS, HashKey};
use tracing::{debug, info};

use super::{Datapath, PROGRAM, PROGRAM_NAME, pin::ensure_bpffs};

impl Datapath {
    /// Load the program against the pinned maps in `pin_dir` (created if absent).
    pub fn load(pin_dir: &Path, max_sources: u32) -> anyhow::Result<Self> {
        Self::load_with(pin_dir, max_sources, |loader| loader.load(PROGRAM))
    }

    /// [`Datapath::load`], with the object loaded by `load` from the loader it is handed (map
    /// pins in `pin_dir`, the per-source maps sized for `max_sources`): for an object that
    /// links the program beside programs and maps of its own, which `load` may size (the
    /// benchmark's).
    pub fn load_with(
        pin_dir: &Path,
        max_sources: u32,
        load: impl FnOnce(&mut EbpfLoader<'_>) -> Result<Ebpf, aya::EbpfError>,
    ) -> anyhow::Result<Self> {
        if let Err(e) = raise_memlock() {
            debug!(
                "raising RLIMIT_MEMLOCK failed ({e}); not needed on kernels with memcg accounting"
            );
        }
        ensure_bpffs(pin_dir)?;
        let adopted = pin_dir.join("RL_STATS").exists();
        let mut loader = EbpfLoader::new();
        loader
            .default_map_pin_directory(pin_dir)
            .map_max_entries(
                "RL_CLIENTS",
                ratelimit_common::maps::store_sets(max_sources),
            )
            .map_max_entries(
                "RL_KNOWN",
                ratelimit_common::maps::known_map_entries(max_sources),
            );
        let ebpf = load(&mut loader).context("loading the XDP program and its maps")?;
        if let Some(name) = super::MAP_NAMES.iter().find(|n| ebpf.map(n).is_none()) {
            bail!("map {name} missing from the XDP object: the daemon and its program differ");
        }
        let mut dp = Self {
            ebpf,
            pin_dir: pin_dir.to_owned(),
            attached: Vec::new(),
            adopted,
            hash_key: [0; HASH_KEY_WORDS],
        };
        dp.hash_key = dp.ensure_hash_key()?;
        let prog: &mut Xdp = dp
            .ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or_else(|| anyhow!("program {PROGRAM_NAME} missing from the object"))?
            .try_into()?;
        prog.load()
            .map_err(|e| anyhow!("the kernel verifier rejected the XDP program: {e:#}"))?;
        if adopted {
            info!(dir = %pin_dir.display(), "adopted pinned maps: counters and bans carried over");
        }
        Ok(dp)
    }

    /// The placement hash's key: the pinned one, or (maps just created, or pinned by a
    /// daemon that stopped before it drew one, and which therefore hold no state) a new one
    /// from the OS's random source, written before any policy gives the store its sets.
    fn ensure_hash_key(&mut self) -> anyhow::Result<HashKey> {
        let map = self
            .ebpf
            .map_mut("RL_HASH_KEY")
            .ok_or_else(|| anyhow!("map RL_HASH_KEY missing from the object"))?;
        let mut a: Array<&mut MapData, HashKey> = Array::try_from(map)?;
        let key = a.get(&0, 0).context("reading RL_HASH_KEY")?;
        if key != [0; HASH_KEY_WORDS] {
            return Ok(key);
        }
        let key = random_hash_key()?;
        a.set(0, key, 0).context("writing RL_HASH_KEY")?;
        Ok(key)
    }

    /// The loaded object: maps no typed handle covers (the log ring, say), and any other
    /// program in it.
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    /// Verifier statistics of the loaded program: (xlated instruction count, verified insns).
    pub fn program_info(&self) -> Option<(u32, u32)> {
        let prog: &Xdp = self.ebpf.program(PROGRAM_NAME)?.try_into().ok()?;
        let info = prog.info().ok()?;
        Some((
            info.size_translated().unwrap_or(0) / 8,
            info.verified_instruction_count().unwrap_or(0),
        ))
    }

    /// Run the program on one frame with BPF_PROG_TEST_RUN, `repeat` times: (XDP action of the
    /// last run, mean time per run). Maps are the real ones, so counters and state change.
    pub fn test_run(
        &self,
        frame: &[u8],
        repeat: u32,
    ) -> anyhow::Result<(u32, std::time::Duration)> {
        use aya::programs::{TestRun as _, TestRunOptions};
        let prog: &Xdp = self
            .ebpf
            .program(PROGRAM_NAME)
            .expect("loaded")
            .try_into()?;
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.repeat = repeat.max(1);
        let r = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?;
        Ok((r.return_value, r.duration))
    }

    /// [`Datapath::test_run`] once, with the frame as the program left it (a reply it sends
    /// back out with `XDP_TX`, say).
    pub fn test_run_out(&self, frame: &[u8]) -> anyhow::Result<(u32, Vec<u8>)> {
        use aya::programs::{TestRun as _, TestRunOptions};
        let prog: &Xdp = self
            .ebpf
            .program(PROGRAM_NAME)
            .expect("loaded")
            .try_into()?;
        let mut out = vec![0u8; frame.len().max(256)];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        let r = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?;
        out.truncate(r.data_size_out as usize);
        Ok((r.return_value, out))
    }

    /// BPF_PROG_TEST_RUN of any program in the object, by name (loading it on first use):
    /// `ratelimit_l3`, say, which [`Datapath::test_run`] does not run.
    pub fn test_run_program(
        &mut self,
        name: &str,
        frame: &[u8],
        repeat: u32,
    ) -> anyhow::Result<(u32, std::time::Duration)> {
        use aya::programs::{TestRun as _, TestRunOptions};
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("no program {name} in the object"))?
            .try_into()?;
        if prog.fd().is_err() {
            prog.load().with_context(|| format!("loading {name}"))?;
        }
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.repeat = repeat.max(1);
        let r = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?;
        Ok((r.return_value, r.duration))
    }
}

/// The placement hash's key, every bit from the kernel's random source (getrandom(2), which
/// blocks only until the pool is first seeded).
fn random_hash_key() -> anyhow::Result<HashKey> {
    let mut b = [0u8; 8 * HASH_KEY_WORDS];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: writes at most `b.len() - got` bytes into `b` from `got` on.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e).context("drawing the placement hash's key from getrandom(2)");
        }
        got += n as usize;
    }
    let key: HashKey = core::array::from_fn(|i| {
        u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"))
    });
    if key == [0; HASH_KEY_WORDS] {
        bail!("getrandom(2) returned only zero bytes: the kernel's random source is broken");
    }
    Ok(key)
}

fn raise_memlock() -> std::io::Result<()> {
    let rlim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: valid rlimit struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
