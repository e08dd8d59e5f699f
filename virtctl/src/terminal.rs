//! Raw mode for the console: every key goes to the guest. The saved settings come back when the
//! guard drops, and also from the panic hook, since a panic may abort before the drop runs.

use std::io::IsTerminal as _;
use std::sync::Mutex;

use anyhow::Context as _;
use nix::sys::termios::{self, SetArg, Termios};

static SAVED: Mutex<Option<Termios>> = Mutex::new(None);

/// Puts stdin's terminal in raw mode until dropped.
#[derive(Debug)]
pub struct RawMode(());

impl RawMode {
    /// `None` when stdin is not a terminal: then there is nothing to change.
    pub fn enter() -> anyhow::Result<Option<Self>> {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Ok(None);
        }
        let saved = termios::tcgetattr(&stdin).context("make raw terminal failed")?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        *SAVED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(saved);
        install_panic_hook();
        termios::tcsetattr(&stdin, SetArg::TCSANOW, &raw).context("make raw terminal failed")?;
        Ok(Some(RawMode(())))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        restore();
    }
}

fn restore() {
    let saved = SAVED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(saved) = saved
        && let Err(e) = termios::tcsetattr(std::io::stdin(), SetArg::TCSANOW, &saved)
    {
        eprintln!("failed to restore terminal: {e}");
    }
}

fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            previous(info);
        }));
    });
}
