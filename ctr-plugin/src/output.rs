//! Output helpers: stdout that survives a closed pipe, aligned tables.

/// `println!` that ends the process quietly when stdout is closed (`| head`), like
/// any Unix filter (exit 141 = SIGPIPE), instead of panicking.
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($t)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(141);
            }
            eprintln!("layerstack: cannot write to stdout: {e}");
            std::process::exit(1);
        }
    }};
}

/// Columns padded to their widest cell, two spaces apart; the last is not padded.
pub fn print_table<const N: usize>(rows: &[[String; N]]) {
    let mut width = [0usize; N];
    for r in rows {
        for (w, cell) in width.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for r in rows {
        let mut line = String::new();
        for (i, cell) in r.iter().enumerate() {
            if i + 1 == N {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}  ", w = width[i]));
            }
        }
        out!("{}", line.trim_end());
    }
}

/// A stack id (`<namespace>/<chainID>`) shortened for tables: the chainID's first
/// 12 hex digits (the namespace has its own column).
pub fn short(stack: &str) -> &str {
    let chain = stack.rsplit('/').next().unwrap_or(stack);
    let s = chain.strip_prefix("sha256:").unwrap_or(chain);
    s.get(..12).unwrap_or(s)
}

/// A spinner on stderr naming `what` and the time taken, drawn only when stderr
/// is a terminal (hidden in pipes, files and journals); `finish_and_clear` it
/// when the operation returns. For one long RPC without progress events
/// (`squash`, `gc`, `diff`).
pub fn spinner(what: &str) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new_spinner();
    b.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    b.set_message(what.to_string());
    b.enable_steady_tick(std::time::Duration::from_millis(120));
    b
}
