//! Where the lines go (a file, reopened after log rotation, or stdout), and writes of whole
//! lines: a write that fails partway leaves no torn line behind if it can help it.

use std::{
    fs::{File, OpenOptions},
    io::{self, Seek as _, SeekFrom},
    os::fd::AsFd as _,
    path::PathBuf,
};

use anyhow::Context as _;

use crate::config::EventsSink;

/// Where event lines go.
pub enum Output {
    None,
    Stdout(Target),
    File { path: PathBuf, target: Target },
}

/// An open file, pipe or terminal to write lines to.
pub struct Target {
    pub(super) file: File,
    /// A regular file, whose torn tail can be cut off.
    regular: bool,
}

impl Target {
    fn new(file: File) -> Target {
        let regular = file.metadata().is_ok_and(|m| m.file_type().is_file());
        Target { file, regular }
    }
}

impl Output {
    pub fn open(target: Option<&EventsSink>) -> anyhow::Result<Output> {
        Ok(match target {
            None => Output::None,
            Some(EventsSink::Stdout) => {
                // Our own descriptor of stdout: written without the process-wide stdout lock.
                let fd = std::io::stdout()
                    .as_fd()
                    .try_clone_to_owned()
                    .context("duplicating stdout for events")?;
                Output::Stdout(Target::new(File::from(fd)))
            }
            Some(EventsSink::File(path)) => Output::File {
                path: path.clone(),
                target: Target::new(open_append(path)?),
            },
        })
    }

    pub(super) fn is_none(&self) -> bool {
        matches!(self, Output::None)
    }

    pub(super) fn describe(&self) -> String {
        match self {
            Output::None => "none".into(),
            Output::Stdout(_) => "stdout".into(),
            Output::File { path, .. } => path.display().to_string(),
        }
    }

    pub(super) fn reopen(&mut self) -> anyhow::Result<()> {
        if let Output::File { path, target } = self {
            *target = Target::new(open_append(path)?);
        }
        Ok(())
    }

    pub(super) fn target(&mut self) -> Option<&mut Target> {
        match self {
            Output::None => None,
            Output::Stdout(t) | Output::File { target: t, .. } => Some(t),
        }
    }
}

fn open_append(path: &std::path::Path) -> anyhow::Result<File> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).ok();
    }
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening events file {}", path.display()))
}

/// How a write of whole lines ended.
pub(super) struct Written {
    /// Bytes of whole lines now in the output (all of them on success).
    pub(super) whole: usize,
    /// The rest of a line the output holds only the start of, to be completed by the next
    /// write (empty when nothing is torn: the write succeeded or the tail was cut off).
    pub(super) torn_rest: Vec<u8>,
    pub(super) error: Option<io::Error>,
}

/// An output that lines are appended to.
pub(super) trait LineOutput: io::Write {
    /// Where the next write lands, if the output is a file that can be cut back.
    fn end(&mut self) -> Option<u64>;
    /// Cut the output back to `len` bytes.
    fn cut(&mut self, len: u64) -> io::Result<()>;
}

impl io::Write for Target {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl LineOutput for Target {
    fn end(&mut self) -> Option<u64> {
        // Appends go to the end of the file.
        self.regular
            .then(|| self.file.seek(SeekFrom::End(0)).ok())
            .flatten()
    }
    fn cut(&mut self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
}

/// Write `bytes` (whole lines ending at `ends`) to `out`. A write that fails partway leaves no
/// torn line behind if it can help it: a file is cut back to its last whole line; any other
/// output (a pipe) gets the rest of the torn line at the next write.
pub(super) fn write_lines(out: &mut impl LineOutput, bytes: &[u8], ends: &[usize]) -> Written {
    let start = out.end();
    let mut off = 0;
    let mut error = None;
    while off < bytes.len() {
        match out.write(&bytes[off..]) {
            Ok(0) => {
                error = Some(io::Error::from(io::ErrorKind::WriteZero));
                break;
            }
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    let whole = ends
        .iter()
        .copied()
        .take_while(|&e| e <= off)
        .last()
        .unwrap_or(0);
    let mut torn_rest = Vec::new();
    if whole < off {
        let cut = start.is_some_and(|s| out.cut(s + whole as u64).is_ok());
        if !cut {
            let end = ends
                .iter()
                .copied()
                .find(|&e| e > off)
                .unwrap_or(bytes.len());
            torn_rest = bytes[off..end].to_vec();
        }
    }
    Written {
        whole,
        torn_rest,
        error,
    }
}
