//! Shell completions and man pages, generated from the command line's definition ([`crate::cli::Cli`]) so that
//! they never fall behind it: `flexstack completions bash|zsh|fish`, `flexstack man [--dir DIR]` (hidden commands;
//! scripts/setup.sh and the .deb of scripts/deb.sh install what they print).

use crate::cli::Cli;
use crate::error::CliError;
use clap::CommandFactory;
use std::io::Write;
use std::path::{Path, PathBuf};

fn io_error(what: &str, e: std::io::Error) -> CliError {
    CliError::Message(format!("{what}: {e}"))
}

/// Writes the completion script of `shell` for `flexstack` to `out`.
pub fn completions(shell: clap_complete::Shell, out: &mut dyn Write) -> Result<(), CliError> {
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "flexstack", out);
    out.flush().map_err(|e| io_error("writing the completion script", e))
}

/// Writes the man page flexstack(1) (roff) to `out`: the same page as the one [`man_pages`] writes.
pub fn man_page(out: &mut dyn Write) -> Result<(), CliError> {
    // As clap_mangen::generate_to prepares it: no `help` command (it has no page), subcommands' names complete.
    let mut cmd = Cli::command().disable_help_subcommand(true);
    cmd.build();
    clap_mangen::Man::new(cmd).render(out).and_then(|()| out.flush()).map_err(|e| io_error("writing the man page", e))
}

/// Writes flexstack.1 and a page per command that is not hidden (flexstack-lab.1, flexstack-lab-run.1 ...) into
/// `dir`, creating it; returns the files written, sorted.
pub fn man_pages(dir: &Path) -> Result<Vec<PathBuf>, CliError> {
    std::fs::create_dir_all(dir).map_err(|e| io_error(&format!("creating {}", dir.display()), e))?;
    clap_mangen::generate_to(Cli::command(), dir)
        .map_err(|e| io_error(&format!("writing into {}", dir.display()), e))?;
    let mut pages: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| io_error(&format!("reading {}", dir.display()), e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "1"))
        .collect();
    pages.sort();
    Ok(pages)
}
