//! Running commands: echo the command line, run it, fail with context.

use std::ffi::OsStr;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};

use anyhow::{Context as _, Result, bail};

/// The workspace root (the parent of the xtask crate).
pub fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

/// The cargo to run: `$CARGO` (set by cargo for `cargo xtask`), else `cargo` from PATH.
pub fn cargo_program() -> std::ffi::OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

/// A cargo command with the workspace root as working directory.
pub fn cargo<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(cargo_program());
    cmd.args(args).current_dir(workspace_root());
    cmd
}

/// Shell-like rendering of a command line, with the environment it sets.
pub fn display(cmd: &Command) -> String {
    let mut parts = Vec::new();
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            parts.push(format!("{}={}", key.to_string_lossy(), quote(value)));
        }
    }
    // `$CARGO` is a long toolchain path: show it as the `cargo` the reader would type.
    if cmd.get_program() == cargo_program() {
        parts.push("cargo".into());
    } else {
        parts.push(quote(cmd.get_program()));
    }
    parts.extend(cmd.get_args().map(quote));
    parts.join(" ")
}

fn quote(word: &OsStr) -> String {
    let word = word.to_string_lossy();
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        word.into_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Prints the command line as a header.
pub fn echo(cmd: &Command) {
    println!("$ {}", display(cmd));
    let _ = std::io::stdout().flush();
}

fn check(cmd: &Command, status: ExitStatus) -> Result<()> {
    if status.success() {
        return Ok(());
    }
    match status.code() {
        Some(code) => bail!("`{}` failed with exit status {code}", display(cmd)),
        None => bail!("`{}` was killed ({status})", display(cmd)),
    }
}

/// Echoes and runs a command with inherited stdio; an error unless it exits with status 0.
pub fn run(cmd: &mut Command) -> Result<()> {
    echo(cmd);
    let status = cmd
        .status()
        .with_context(|| format!("cannot start `{}`", display(cmd)))?;
    check(cmd, status)
}

/// Runs a command quietly and returns its stdout; an error unless it exits with status 0.
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot start `{}`", display(cmd)))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        check(cmd, out.status).with_context(|| stderr.trim().to_string())?;
    }
    String::from_utf8(out.stdout)
        .with_context(|| format!("`{}`: stdout is not UTF-8", display(cmd)))
}

/// Runs a command quietly; `None` when it cannot be started at all (not installed).
pub fn probe(cmd: &mut Command) -> Option<Output> {
    cmd.stdin(Stdio::null()).output().ok()
}

/// Echoes and runs a command, copying its stdout to ours as it comes while capturing it.
/// Returns the captured stdout; an error (after the copy) unless it exits with status 0.
pub fn run_tee(cmd: &mut Command) -> (Result<()>, String) {
    echo(cmd);
    let mut child = match cmd.stdout(Stdio::piped()).spawn() {
        Ok(child) => child,
        Err(error) => {
            let error =
                anyhow::Error::new(error).context(format!("cannot start `{}`", display(cmd)));
            return (Err(error), String::new());
        }
    };
    let mut captured = Vec::new();
    if let Some(mut pipe) = child.stdout.take() {
        let mut stdout = std::io::stdout().lock();
        let mut buf = [0u8; 8192];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    captured.extend_from_slice(&buf[..n]);
                    let _ = stdout.write_all(&buf[..n]);
                    let _ = stdout.flush();
                }
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }
    let captured = String::from_utf8_lossy(&captured).into_owned();
    let result = child
        .wait()
        .with_context(|| format!("waiting for `{}`", display(cmd)))
        .and_then(|status| check(cmd, status));
    (result, captured)
}

/// Whether a program can be started from PATH (`PROGRAM ARG` exits 0).
pub fn works(program: impl AsRef<OsStr>, arg: &str) -> bool {
    probe(Command::new(program).arg(arg)).is_some_and(|out| out.status.success())
}

/// The cargo target directory (honours CARGO_TARGET_DIR and the config), as an absolute path.
pub fn target_dir() -> Result<PathBuf> {
    let json = output(&mut cargo([
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
    ]))
    .context("reading the workspace metadata")?;
    let metadata: serde_json::Value =
        serde_json::from_str(&json).context("parsing `cargo metadata` output")?;
    let dir = metadata["target_directory"]
        .as_str()
        .context("`cargo metadata` has no target_directory")?;
    Ok(PathBuf::from(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_quotes_what_the_shell_would_split() {
        let mut cmd = Command::new("cargo");
        cmd.args(["test", "--", "a b", "it's"]).env("X", "1");
        assert_eq!(display(&cmd), r"X=1 cargo test -- 'a b' 'it'\''s'");
    }
}
