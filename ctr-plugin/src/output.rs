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
/// 12 hex digits (the namespace has its own column); an imported base's
/// (`import:sha256:<hex>`) keeps its `import:`.
pub fn short(stack: &str) -> String {
    if let Some(d) = stack.strip_prefix(layerstack_api::types::IMPORT_STACK_PREFIX) {
        let hex = d.strip_prefix("sha256:").unwrap_or(d);
        return format!("import:{}", hex.get(..12).unwrap_or(hex));
    }
    let chain = stack.rsplit('/').next().unwrap_or(stack);
    let s = chain.strip_prefix("sha256:").unwrap_or(chain);
    s.get(..12).unwrap_or(s).to_string()
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

#[cfg(test)]
mod tests {
    #[test]
    fn stack_ids_shorten_to_their_digest_and_keep_import() {
        let hex = "0123456789abcdef".repeat(4);
        assert_eq!(
            super::short(&format!("default/sha256:{hex}")),
            "0123456789ab"
        );
        assert_eq!(
            super::short(&format!("import:sha256:{hex}")),
            "import:0123456789ab"
        );
    }
}
