//! Files the daemon keeps in `state_dir` (the bans, the rule names, the pinned maps' layout):
//! written whole or not at all, and durable once written. A file is written under a temporary
//! name, synced, renamed over the old one, and then its directory is synced: the new name is
//! an entry of the directory, and until the directory is on disk a crash (a power cut) may
//! bring back the old file, or no file at all, although the write "succeeded".
//!
//! And a file that cannot be used is never destroyed: [`set_aside`] moves it to a name of its
//! own, [`keep_copy`] keeps a second name for it, both without replacing any earlier copy.
//!
//! Files are made mode 0600 and never through a link: the temporary name is created with
//! `O_CREAT | O_EXCL | O_NOFOLLOW` (a link planted under it is an error, not a file written
//! elsewhere), and `rename` replaces a link at the final name rather than following it. The
//! directory itself is checked at start ([`check_private_dir`]): a `state_dir` that another
//! user can write is refused, since whoever can write it can plant bans, rule names or the
//! fleet cursor for the daemon to read.

use std::{
    fs::File,
    io::{self, Write as _},
    os::unix::fs::{MetadataExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;

/// Write `bytes` as `dir/name`, atomically and durably: `dir/.name.tmp` made anew (mode
/// 0600, never through a link), written and synced, renamed onto `dir/name`, then `dir`
/// synced. `dir` is created (mode 0700) if missing.
pub fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    create_private_dir(dir)?;
    let tmp = dir.join(format!(".{name}.tmp"));
    let path = dir.join(name);
    let written = (|| -> io::Result<()> {
        // A temporary file an earlier crash left (or a link put there): unlinked, never
        // followed.
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut f = new_private_file(&tmp)?;
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

/// A new file at `path`, mode 0600, failing if anything (a link included) is there already.
fn new_private_file(path: &Path) -> io::Result<File> {
    File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Create `dir` and its missing parents, the new ones mode 0700.
pub fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))
}

/// Refuse a directory the daemon keeps its state in (created mode 0700 if missing) when
/// another user can write it: it must belong to this process's user (or root) and not be
/// writable by its group or others. Whoever could write it could plant the bans, rule names,
/// fleet cursor or outbox the daemon reads at start, or links for it to write through.
pub fn check_private_dir(dir: &Path, field: &str) -> anyhow::Result<()> {
    create_private_dir(dir)?;
    let meta = std::fs::metadata(dir).with_context(|| format!("reading {}", dir.display()))?;
    if !meta.is_dir() {
        anyhow::bail!("{field} {} is not a directory", dir.display());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && meta.uid() != 0 {
        anyhow::bail!(
            "{field} {} belongs to uid {}, not to this daemon's user (uid {me}) or root: another \
             user could change the state the daemon reads; chown it, or choose another directory",
            dir.display(),
            meta.uid()
        );
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        anyhow::bail!(
            "{field} {} is writable by {} (mode {mode:04o}): another user could change the state \
             the daemon reads; run `chmod go-w {}`, or choose another directory",
            dir.display(),
            if mode & 0o002 != 0 {
                "every user"
            } else {
                "its group"
            },
            dir.display()
        );
    }
    Ok(())
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

/// What reading a state file in `state_dir` gave ([`load`]).
#[derive(Debug)]
pub enum Loaded<T> {
    /// No file: nothing was saved.
    Missing,
    /// The file, parsed.
    Read(T),
    /// The file is there but could not be read (the error): it is left in place, and nothing
    /// should be saved over it.
    Unreadable(std::io::Error),
    /// The file did not parse (the error) and was moved aside, to the path given, or could not
    /// be (why).
    Bad {
        error: String,
        aside: Result<PathBuf, String>,
    },
}

/// The one reader of the daemon's state files (`bans.json`, `live.json`, the fleet's outbox,
/// its lifted bans, the pressure mode): read `path` and `parse` it; a file that does not parse
/// is moved aside (`path.bad-<unix time>`) so that the next save starts clean and the operator
/// keeps what was there. Each caller says what became of it in its own words.
pub fn load<T, E: std::fmt::Display>(
    path: &Path,
    parse: impl FnOnce(&[u8]) -> Result<T, E>,
) -> Loaded<T> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Loaded::Missing,
        Err(e) => return Loaded::Unreadable(e),
    };
    match parse(&bytes) {
        Ok(v) => Loaded::Read(v),
        Err(e) => Loaded::Bad {
            error: e.to_string(),
            aside: set_aside(path, "bad").map_err(|e| format!("{e:#}")),
        },
    }
}

/// Where a bad file went, in a log line's words: "moved to PATH" or "could not be moved aside:
/// WHY".
pub fn aside_words(aside: &Result<PathBuf, String>) -> String {
    match aside {
        Ok(p) => format!("moved to {}", p.display()),
        Err(e) => format!("could not be moved aside: {e}"),
    }
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
    let mut out = new_private_file(to)?;
    io::copy(&mut File::open(from)?, &mut out)?;
    out.sync_all()
}

/// The bytes of a file holding a secret (the config key `field` names it): refused if it is
/// missing, or if its mode grants any of `forbidden` (`0o004`: readable by every user;
/// `0o044`: by its group too), with the `chmod` that makes it private.
pub fn read_secret(path: &Path, field: &str, forbidden: u32) -> anyhow::Result<Vec<u8>> {
    use std::os::unix::fs::PermissionsExt as _;
    let meta = std::fs::metadata(path).with_context(|| format!("{field} {}", path.display()))?;
    let mode = meta.permissions().mode();
    if mode & forbidden != 0 {
        let who = if forbidden & 0o040 != 0 {
            "other users"
        } else {
            "every user"
        };
        anyhow::bail!(
            "{field} {} is readable by {who} (mode {:04o}); make it private first, e.g. \
             `chmod 600 {}`",
            path.display(),
            mode & 0o7777,
            path.display()
        );
    }
    std::fs::read(path).with_context(|| format!("reading {field} {}", path.display()))
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

    /// State files are 0600 and never written through a link: a link planted at the
    /// temporary name (pointing at a file the attacker wants overwritten) is removed, not
    /// followed, and one at the final name is replaced, not followed.
    #[test]
    fn state_files_are_private_and_never_written_through_a_link() {
        use std::os::unix::fs::{PermissionsExt as _, symlink};
        let dir = temp_dir("links");
        let victim = dir.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        symlink(&victim, dir.join(".bans.json.tmp")).unwrap();
        symlink(&victim, dir.join("bans.json")).unwrap();
        write_atomically(&dir, "bans.json", b"{}").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        let meta = std::fs::symlink_metadata(dir.join("bans.json")).unwrap();
        assert!(
            meta.file_type().is_file(),
            "the link was replaced by a file"
        );
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read(dir.join("bans.json")).unwrap(), b"{}");
        // A copy kept aside is private too.
        let copy = keep_copy(&dir.join("bans.json"), "bad").unwrap();
        assert_eq!(
            std::fs::metadata(copy).unwrap().permissions().mode() & 0o777,
            0o600
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_state_dir_others_can_write_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = temp_dir("private");
        let new = dir.join("made/here");
        check_private_dir(&new, "state_dir").unwrap();
        assert_eq!(
            std::fs::metadata(&new).unwrap().permissions().mode() & 0o777,
            0o700
        );
        for (mode, who) in [
            (0o777, "every user"),
            (0o775, "its group"),
            (0o1777, "every user"),
        ] {
            std::fs::set_permissions(&new, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = check_private_dir(&new, "state_dir")
                .unwrap_err()
                .to_string();
            assert!(e.contains(who) && e.contains("chmod go-w"), "{mode:o}: {e}");
        }
        std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).unwrap();
        check_private_dir(&new, "state_dir").unwrap();
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

    #[test]
    fn a_state_file_is_missing_read_unreadable_or_set_aside() {
        let dir = temp_dir("load");
        let path = dir.join("state.json");
        let parse = |b: &[u8]| serde_json::from_slice::<Vec<u32>>(b);
        assert!(matches!(load(&path, parse), Loaded::Missing));
        std::fs::write(&path, b"[1, 2]").unwrap();
        assert!(matches!(load(&path, parse), Loaded::Read(v) if v == [1, 2]));
        // Not a list: moved aside, its bytes kept, the name free for the next save.
        std::fs::write(&path, b"{\"not\": \"a list\"}").unwrap();
        let Loaded::Bad { error, aside } = load(&path, parse) else {
            panic!("a bad file was not reported as bad");
        };
        assert!(error.contains("expected a sequence"), "{error}");
        let to = aside.expect("moved aside");
        assert!(!path.exists());
        assert_eq!(std::fs::read(&to).unwrap(), b"{\"not\": \"a list\"}");
        assert!(aside_words(&Ok(to.clone())).starts_with("moved to "));
        // A directory where the file should be cannot be read: left in place.
        std::fs::create_dir(&path).unwrap();
        assert!(matches!(load(&path, parse), Loaded::Unreadable(_)));
        assert!(path.is_dir());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
