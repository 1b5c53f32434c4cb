//! The error of a `flexstack` command, shared by the CLI, `flexstack run` and the lab runner; its kind decides the
//! exit code (see the CLI's `main`).

use flexstack_api::client::ClientError;

/// A failure of a CLI command.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// From the control connection or the daemon.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// Anything else, already worded.
    #[error("{0}")]
    Message(String),
    /// An input file (lab, stack) is invalid: exit code 2, nothing was created.
    #[error("{0}")]
    Config(String),
    /// Exit with this code after printing the message as it is (`flexstack run: x: command not found`, 127).
    #[error("{1}")]
    Exit(u8, String),
}

/// A [`CliError::Message`] saying `e`.
pub fn msg(e: impl std::fmt::Display) -> CliError {
    CliError::Message(e.to_string())
}

/// The error of an operation the kernel refused for want of privileges: says that it needs root (or sudo) and
/// which operation needed it.
pub fn needs_root(operation: &str) -> CliError {
    CliError::Message(format!(
        "{operation}: permission denied; this needs root: run it as root or with sudo (e.g. `sudo flexstack ...`)"
    ))
}

/// Fails unless we run as root: `command` needs root because `why`; the message says to use sudo.
pub fn require_root(command: &str, why: &str) -> Result<(), CliError> {
    if nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    Err(CliError::Message(format!(
        "{command} needs root ({why}): run it as root or with sudo, e.g. `sudo {command} ...`"
    )))
}

/// Where `program` is, as a shell finds it: a path as given, or the first executable file of that name in `PATH`.
fn find_program(program: &str) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable =
        |p: &std::path::Path| p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.contains('/') {
        let p = std::path::PathBuf::from(program);
        return executable(&p).then_some(p);
    }
    let path =
        std::env::var("PATH").unwrap_or_else(|_| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    path.split(':').filter(|d| !d.is_empty()).map(|d| std::path::Path::new(d).join(program)).find(|p| executable(p))
}

/// Fails as a shell does when the program of `argv` cannot be run, before anything is set up for it: exit code
/// 127 and `<command>: <program>: command not found` (a path: `No such file or directory`), or 126 for a file that
/// is not executable.
pub fn program_exists(command: &str, argv: &[String]) -> Result<(), CliError> {
    let Some(program) = argv.first() else { return Ok(()) };
    if find_program(program).is_some() {
        return Ok(());
    }
    if !program.contains('/') {
        return Err(CliError::Exit(127, format!("{command}: {program}: command not found")));
    }
    if std::path::Path::new(program).exists() {
        return Err(CliError::Exit(126, format!("{command}: {program}: Permission denied (not an executable file)")));
    }
    Err(CliError::Exit(127, format!("{command}: {program}: No such file or directory")))
}

/// For a command line that clap refused: when it is `flexstack run` or `flexstack lab exec` without `--` before
/// the program, the command line with `--` where it belongs.
pub fn missing_separator(args: &[String]) -> Option<String> {
    if args.iter().any(|a| a == "--") {
        return None;
    }
    // Skips the global options and their values: --state-dir DIR, -j.
    let mut i = 1;
    let mut words: Vec<&str> = Vec::new();
    while i < args.len() {
        match args[i].as_str() {
            "--state-dir" => i += 1,
            "-j" | "--json" => {}
            a if a.starts_with("--state-dir=") => {}
            a => {
                words.push(a);
                if matches!(words.as_slice(), ["run"] | ["lab", "exec"]) {
                    break;
                }
            }
        }
        i += 1;
    }
    let (options_with_value, positionals): (&[&str], usize) = match words.as_slice() {
        ["run"] => (&["--stack", "--name"], 0),
        ["lab", "exec"] => (&["--lab"], 1),
        _ => return None,
    };
    // After the subcommand: its own options, then its positionals (lab exec: HOST), then the program.
    let mut j = i + 1;
    let mut seen = 0;
    while j < args.len() {
        let a = args[j].as_str();
        if options_with_value.contains(&a) {
            j += 2;
        } else if options_with_value.iter().any(|o| a.starts_with(&format!("{o}="))) {
            j += 1;
        } else if seen < positionals && !a.starts_with('-') {
            seen += 1;
            j += 1;
        } else {
            break;
        }
    }
    if j >= args.len() {
        return None;
    }
    let mut fixed: Vec<&str> = vec!["flexstack"];
    fixed.extend(args[1..j].iter().map(String::as_str));
    fixed.push("--");
    fixed.extend(args[j..].iter().map(String::as_str));
    Some(fixed.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_separator_goes_before_the_program() {
        let fix = |l: &str| missing_separator(&args(l));
        assert_eq!(fix("flexstack run curl -s http://x").as_deref(), Some("flexstack run -- curl -s http://x"));
        assert_eq!(
            fix("flexstack --state-dir /s run --name a --stack=s.toml curl -s").as_deref(),
            Some("flexstack --state-dir /s run --name a --stack=s.toml -- curl -s")
        );
        assert_eq!(
            fix("flexstack lab exec --lab l h1 ping -c 1 h2").as_deref(),
            Some("flexstack lab exec --lab l h1 -- ping -c 1 h2")
        );
        assert_eq!(fix("flexstack run -- curl -s"), None);
        assert_eq!(fix("flexstack get -x"), None);
        assert_eq!(fix("flexstack run"), None);
    }

    #[test]
    fn programs_are_found_as_a_shell_finds_them() {
        assert!(find_program("sh").is_some());
        assert!(find_program("/bin/sh").is_some());
        assert!(find_program("fs-no-such-program-here").is_none());
        let e = program_exists("flexstack run", &["fs-no-such-program-here".into()]).unwrap_err();
        assert!(
            matches!(e, CliError::Exit(127, ref m) if m == "flexstack run: fs-no-such-program-here: command not found")
        );
        let plain = tempfile::NamedTempFile::new().unwrap();
        let e = program_exists("x", &[plain.path().display().to_string()]).unwrap_err();
        assert!(matches!(e, CliError::Exit(126, _)), "{e}");
    }
}
