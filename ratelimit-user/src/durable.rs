//! Files the daemon keeps in `state_dir` (the bans, the rule names, the pinned maps' layout):
//! written whole or not at all, and durable once written. A file is written under a temporary
//! name, synced, renamed over the old one, and then its directory is synced: the new name is
//! an entry of the directory, and until the directory is on disk a crash (a power cut) may
//! bring back the old file, or no file at all, although the write "succeeded".
//!
//! And a file that cannot be used is never destroyed: [`set_aside`] moves it to a name of its
//! own, [`keep_copy`] keeps a second name for it, both without replacing any earlier copy.

use std::{
    fs::File,
    io::{self, Write as _},
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;

/// Write `bytes` as `dir/name`, atomically and durably: `dir/.name.tmp` written and synced,
/// renamed onto `dir/name`, then `dir` synced. `dir` is created if missing.
pub fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".{name}.tmp"));
    let path = dir.join(name);
    let written = (|| -> io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", tmp.display()));
    }
    if let Err(e) = std::fs::rename(&tmp, &path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()));
    }
    sync_dir(dir)
}

/// fsync a directory: makes the renames, links and unlinks in it durable.
pub fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))
}

/// Move `path` aside to `path.<label>-<unix time>` (`-2`, `-3`... if that is taken, so no
/// earlier copy is ever replaced) and sync its directory. Returns the new name.
pub fn set_aside(path: &Path, label: &str) -> anyhow::Result<PathBuf> {
    let to = second_name(path, label)?;
    std::fs::remove_file(path).with_context(|| {
        format!(
            "removing {} (its content is kept as {})",
            path.display(),
            to.display()
        )
    })?;
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    Ok(to)
}

/// Keep a copy of `path` as `path.<label>-<unix time>` (as [`set_aside`] names it), leaving
/// `path` in place. Returns the copy's name.
pub fn keep_copy(path: &Path, label: &str) -> anyhow::Result<PathBuf> {
    let to = second_name(path, label)?;
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    Ok(to)
}

/// A second name for `path`'s content, `path.<label>-<unix time>[-N]`, made without replacing
/// any file: a hard link (which fails if the name exists), or a copy where the file system
/// has no hard links.
fn second_name(path: &Path, label: &str) -> anyhow::Result<PathBuf> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let base = format!("{}.{label}-{secs}", path.display());
    for n in 1..1000 {
        let to = PathBuf::from(if n == 1 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        match std::fs::hard_link(path, &to) {
            Ok(()) => return Ok(to),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(_) if !to.exists() => {
                copy_new(path, &to)
                    .with_context(|| format!("copying {} to {}", path.display(), to.display()))?;
                return Ok(to);
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("linking {} as {}", path.display(), to.display()));
            }
        }
    }
    anyhow::bail!("no free name {base}-N for a copy of {}", path.display())
}

/// Copy `from` to `to`, which must not exist, and sync it.
fn copy_new(from: &Path, to: &Path) -> io::Result<()> {
    let mut out = File::options().write(true).create_new(true).open(to)?;
    io::copy(&mut File::open(from)?, &mut out)?;
    out.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "ratelimit-durable-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn an_atomic_write_replaces_the_file_and_leaves_no_temporary_file() {
        let dir = temp_dir("write");
        write_atomically(&dir, "x.json", b"one").unwrap();
        write_atomically(&dir, "x.json", b"two").unwrap();
        assert_eq!(std::fs::read(dir.join("x.json")).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["x.json"]);
        // A directory in the way: an error naming the file, and the temporary file removed.
        std::fs::remove_file(dir.join("x.json")).unwrap();
        std::fs::create_dir_all(dir.join("x.json/in-the-way")).unwrap();
        let e = format!(
            "{:#}",
            write_atomically(&dir, "x.json", b"three").unwrap_err()
        );
        assert!(e.contains("x.json"), "{e}");
        assert!(!dir.join(".x.json.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn copies_set_aside_never_replace_an_earlier_one() {
        let dir = temp_dir("aside");
        let path = dir.join("bans.json");
        std::fs::write(&path, "first").unwrap();
        let a = set_aside(&path, "bad").unwrap();
        assert!(!path.exists());
        std::fs::write(&path, "second").unwrap();
        let b = set_aside(&path, "bad").unwrap();
        std::fs::write(&path, "third").unwrap();
        let c = keep_copy(&path, "bad").unwrap();
        assert!(path.exists());
        assert_ne!(a, b);
        assert_ne!(b, c);
        assert_eq!(std::fs::read_to_string(&a).unwrap(), "first");
        assert_eq!(std::fs::read_to_string(&b).unwrap(), "second");
        assert_eq!(std::fs::read_to_string(&c).unwrap(), "third");
        let name = a.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("bans.json.bad-"), "{name}");
        // The copy is a name of its own: replacing the file leaves it as it was.
        write_atomically(&dir, "bans.json", b"fourth").unwrap();
        assert_eq!(std::fs::read_to_string(&c).unwrap(), "third");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
