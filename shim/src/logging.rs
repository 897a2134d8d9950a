//! Logging to `<bundle>/log`, the FIFO containerd reads and copies into its own
//! log (`journalctl -u containerd`), in containerd's logfmt shape.
//!
//! The server opens the FIFO once at startup (containerd holds the read side
//! while the shim runs). The `delete` action has stdout reserved for its protobuf
//! reply: it writes to the FIFO if containerd still reads it, else to stderr
//! (containerd logs that as "cleanup warnings").
//!
//! Records of this crate and of `containerd_shim` pass at the configured level
//! (debug when containerd runs at debug level and passes `-debug`); those of
//! libraries (h2, tonic, hyper, …) only at warn and above.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Mutex;

/// A `log` logger writing one logfmt line per record.
pub struct LineLogger {
    out: Mutex<Box<dyn Write + Send>>,
    level: log::LevelFilter,
    fields: String,
}

fn ours(target: &str) -> bool {
    target.starts_with("layerstack_shim")
        || target.starts_with("containerd_shim")
        || target.starts_with("containerd_shim_layerstack")
}

/// `YYYY-MM-DDTHH:MM:SS.nnnnnnnnnZ` (UTC) without a date library.
fn rfc3339_now() -> String {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let (year, month, day, hh, mm, ss) = layerstack_types::time::civil_utc(d.as_secs() as i64);
    format!(
        "{year:04}-{month:02}-{day:02}T{hh:02}:{mm:02}:{ss:02}.{:09}Z",
        d.subsec_nanos()
    )
}

impl log::Log for LineLogger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        let limit = if ours(m.target()) {
            self.level
        } else {
            log::LevelFilter::Warn
        };
        m.level() <= limit
    }

    fn log(&self, r: &log::Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let level = match r.level() {
            log::Level::Error => "error",
            log::Level::Warn => "warning",
            log::Level::Info => "info",
            log::Level::Debug => "debug",
            log::Level::Trace => "trace",
        };
        let msg = r
            .args()
            .to_string()
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', " ");
        let line = format!(
            "time=\"{}\" level={level} msg=\"{msg}\"{}\n",
            rfc3339_now(),
            self.fields
        );
        if let Ok(mut o) = self.out.lock() {
            let _ = o.write_all(line.as_bytes());
            let _ = o.flush();
        }
    }

    fn flush(&self) {
        if let Ok(mut o) = self.out.lock() {
            let _ = o.flush();
        }
    }
}

fn install(out: Box<dyn Write + Send>, debug: bool, fields: String) {
    let level = if debug {
        log::LevelFilter::Debug
    } else {
        log::LevelFilter::Info
    };
    let logger = LineLogger {
        out: Mutex::new(out),
        level,
        fields,
    };
    if log::set_boxed_logger(Box::new(logger)).is_ok() {
        log::set_max_level(level);
    }
}

fn fields(namespace: &str, id: &str, action: &str) -> String {
    format!(
        " runtime={} namespace={namespace} id={id}{action}",
        crate::RUNTIME_NAME
    )
}

/// Opens `<bundle>/log` for writing without blocking (fails if no reader).
fn open_fifo(bundle: &Path) -> Option<File> {
    let f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(bundle.join("log"))
        .ok()?;
    let is_fifo = f
        .metadata()
        .map(|m| std::os::unix::fs::FileTypeExt::is_fifo(&m.file_type()))
        .unwrap_or(false);
    is_fifo.then_some(f)
}

/// The server's logger: `log` in the current directory (the bundle).
pub fn init_server_logger(namespace: &str, id: &str, debug: bool) {
    let out: Box<dyn Write + Send> = match open_fifo(Path::new(".")) {
        Some(f) => Box::new(f),
        None => Box::new(std::io::sink()),
    };
    install(out, debug, fields(namespace, id, ""));
}

/// The `delete` action's logger.
pub fn init_delete_logger(bundle: &Path, namespace: &str, id: &str, debug: bool) {
    let out: Box<dyn Write + Send> = match open_fifo(bundle) {
        Some(f) => Box::new(f),
        None => Box::new(std::io::stderr()),
    };
    install(out, debug, fields(namespace, id, " action=delete"));
}

#[cfg(test)]
mod tests {
    #[test]
    fn timestamps_look_like_rfc3339() {
        let t = super::rfc3339_now();
        assert_eq!(t.len(), "2026-11-29T17:28:40.981494000Z".len(), "{t}");
        assert!(
            t.starts_with("20") && t.ends_with('Z') && &t[10..11] == "T",
            "{t}"
        );
    }
}
