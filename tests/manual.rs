//! The shell completions and man pages generated from the CLI definition (`flexstack completions SHELL`,
//! `flexstack man [--dir DIR]`): every script names every visible command, bash really completes with it, and the
//! pages render with `man -l` without a warning.

mod common;

use clap::CommandFactory;
use common::bin;
use std::process::{Command, Output, Stdio};

fn flexstack(args: &[&str]) -> Output {
    Command::new(bin()).args(args).stdin(Stdio::null()).output().expect("run flexstack")
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "{}: {}", o.status, String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The commands `flexstack --help` shows, from the definition itself.
fn visible_commands() -> Vec<String> {
    let cmd = flexstack::cli::Cli::command();
    let names: Vec<String> =
        cmd.get_subcommands().filter(|c| !c.is_hide_set()).map(|c| c.get_name().to_string()).collect();
    assert!(names.len() >= 15 && names.iter().any(|n| n == "lab"), "{names:?}");
    names
}

#[test]
fn completion_scripts_name_every_command() {
    let commands = visible_commands();
    for shell in ["bash", "zsh", "fish"] {
        let script = stdout(&flexstack(&["completions", shell]));
        for c in &commands {
            assert!(script.contains(c.as_str()), "{shell} completions lack `{c}`");
        }
        // Second-level commands and options too.
        for word in ["rollback", "state-dir", "json"] {
            assert!(script.contains(word), "{shell} completions lack `{word}`");
        }
    }
    let bad = flexstack(&["completions", "tcsh"]);
    assert!(!bad.status.success(), "an unknown shell was accepted");
}

/// What bash completes for the words `line` (the last one being typed), with the generated script loaded.
fn bash_complete(script: &std::path::Path, line: &[&str]) -> Vec<String> {
    let words = line.iter().map(|w| format!("'{w}'")).collect::<Vec<_>>().join(" ");
    let program = format!(
        "source '{}' && complete -p flexstack >&2 && COMP_WORDS=({words}) && COMP_CWORD={} && \
         COMP_LINE='{}' && COMP_POINT=${{#COMP_LINE}} && _flexstack flexstack '{}' '{}' && printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display(),
        line.len() - 1,
        line.join(" "),
        line[line.len() - 1],
        line.get(line.len().wrapping_sub(2)).unwrap_or(&""),
    );
    let out = Command::new("bash").args(["--norc", "--noprofile", "-c", &program]).output().expect("run bash");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bash: {err}");
    assert!(err.contains("complete") && err.contains("flexstack"), "`complete -p flexstack` printed {err:?}");
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
}

#[test]
fn bash_completes_commands_with_the_script() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("flexstack");
    std::fs::write(&script, stdout(&flexstack(&["completions", "bash"]))).unwrap();
    let got = bash_complete(&script, &["flexstack", "la"]);
    assert_eq!(got, ["lab"], "completing `flexstack la`");
    let got = bash_complete(&script, &["flexstack", "config", "ro"]);
    assert_eq!(got, ["rollback"], "completing `flexstack config ro`");
    let got = bash_complete(&script, &["flexstack", ""]);
    for c in visible_commands() {
        assert!(got.contains(&c), "`flexstack <TAB>` does not offer {c}: {got:?}");
    }
}

/// `man -l FILE` as text; fails on any warning from the formatter.
fn render(page: &std::path::Path) -> String {
    let out = Command::new("man")
        .args(["--warnings=all", "-E", "UTF-8", "-P", "cat", "-l"])
        .arg(page)
        .env("MANWIDTH", "100")
        .output()
        .expect("run man");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "man -l {}: {}: {err}", page.display(), out.status);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn man_pages_render() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("stdout.1");
    std::fs::write(&main, stdout(&flexstack(&["man"]))).unwrap();
    let text = render(&main);
    // Words only: man justifies the lines.
    let words = text.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(words.contains("NAME flexstack - A user-space, modular, runtime-reconfigurable network stack"), "{text}");
    for c in visible_commands() {
        assert!(text.contains(&format!("flexstack-{c}(1)")), "flexstack(1) does not list {c}:\n{text}");
    }
    let pages = dir.path().join("pages");
    let o = flexstack(&["man", "--dir", pages.to_str().unwrap()]);
    stdout(&o);
    for c in visible_commands() {
        assert!(pages.join(format!("flexstack-{c}.1")).is_file(), "no page for {c}");
    }
    assert!(!pages.join("flexstack-man.1").exists(), "a page for a hidden command");
    assert_eq!(std::fs::read(pages.join("flexstack.1")).unwrap(), std::fs::read(&main).unwrap());
    let lab_run = render(&pages.join("flexstack-lab-run.1"));
    assert!(lab_run.contains("flexstack-lab-run") && lab_run.contains("SYNOPSIS"), "{lab_run}");
    let daemon = render(&pages.join("flexstack-daemon.1"));
    assert!(daemon.contains("--metrics"), "{daemon}");
}

/// scripts/deb.sh packages this build and checks the package in a scratch root (dpkg -x): `flexstack --help`,
/// `man flexstack`, bash completion and the examples.
#[test]
fn debian_package_installs_and_works() {
    let out = tempfile::tempdir().unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/deb.sh");
    let o = Command::new(script)
        .args(["--binary", bin(), "--out", out.path().to_str().unwrap(), "--check"])
        .output()
        .expect("run scripts/deb.sh");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "scripts/deb.sh: {}\n{err}", o.status);
    assert!(err.contains("checked in a scratch root"), "{err}");
    let deb = String::from_utf8_lossy(&o.stdout).trim().to_string();
    assert!(deb.ends_with(".deb") && std::path::Path::new(&deb).starts_with(out.path()), "{deb}");
    let contents = Command::new("dpkg-deb").args(["--contents", &deb]).output().expect("dpkg-deb");
    let contents = String::from_utf8_lossy(&contents.stdout);
    for path in [
        "./usr/bin/flexstack",
        "./usr/share/bash-completion/completions/flexstack",
        "./usr/share/zsh/vendor-completions/_flexstack",
        "./usr/share/fish/vendor_completions.d/flexstack.fish",
        "./usr/share/man/man1/flexstack.1.gz",
        "./usr/share/man/man1/flexstack-lab-run.1.gz",
        "./usr/share/doc/flexstack/examples/stacks/example.toml",
        "./usr/share/doc/flexstack/examples/labs/demo.toml",
    ] {
        assert!(contents.lines().any(|l| l.ends_with(path)), "{path} not in the package:\n{contents}");
    }
}
