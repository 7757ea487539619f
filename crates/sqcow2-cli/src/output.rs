//! Output formats and human-readable sizes shared by the read-out commands.

/// How a read-out command prints its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Text for people.
    Human,
    /// JSON for programs, with `qemu-img`'s field names where it has them.
    Json,
}

/// Writes `value` as pretty JSON and a newline.
pub fn print_json(
    out: &mut impl std::io::Write,
    value: &impl serde::Serialize,
) -> anyhow::Result<()> {
    serde_json::to_writer_pretty(&mut *out, value)?;
    writeln!(out)?;
    Ok(())
}

/// A size the way qemu-img prints it: `1 GiB`, `196 KiB`, `512 B`.
pub fn human_size(bytes: u64) -> String {
    // QEMU's size_to_str: the next unit from 1000 of one on, three
    // significant digits (`%0.3g`).
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    let decimals = if value >= 99.95 {
        0
    } else if value >= 9.995 {
        1
    } else if value >= 0.9995 {
        2
    } else {
        3
    };
    let s = format!("{value:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        &s
    };
    format!("{s} {}", UNITS[unit])
}

/// Parses a size like qemu-img and qemu-io (see
/// [`sqcow2_format::parse_size`]).
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    Ok(sqcow2_format::parse_size(s)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(human_size(512), "512 B");
        assert_eq!(human_size(1 << 30), "1 GiB");
        assert_eq!(human_size(196 * 1024), "196 KiB");
        assert_eq!(human_size(1536), "1.5 KiB");
        // Three significant digits, the next unit from 1000 on (qemu-img
        // printed these).
        assert_eq!(human_size(2_297_856), "2.19 MiB");
        assert_eq!(human_size(1000 * 1024), "0.977 MiB");
        assert_eq!(human_size(999), "999 B");
        assert_eq!(human_size(266_240), "260 KiB");
    }
}

/// A progress bar on standard error: drawn in place on a terminal; where
/// standard error is not one, hidden, or with `forced` (`-p`) one plain
/// line a second (a log keeps them). [`Progress::finish`] leaves the
/// finished state shown either way, as qemu-img's last `(100.00/100%)`.
#[derive(Debug)]
pub struct Progress {
    bar: indicatif::ProgressBar,
    /// The plain-line target's state, when there is one.
    lines: Option<std::sync::Arc<LineState>>,
}

impl std::ops::Deref for Progress {
    type Target = indicatif::ProgressBar;
    fn deref(&self) -> &indicatif::ProgressBar {
        &self.bar
    }
}

impl Progress {
    /// No bar at all (`-q`).
    pub fn hidden() -> Self {
        Progress {
            bar: indicatif::ProgressBar::hidden(),
            lines: None,
        }
    }

    /// The work is done: the last state is drawn (on a plain-line target
    /// whatever the time since the last line) and stays.
    pub fn finish(&self) {
        if let Some(lines) = &self.lines {
            lines.unthrottle();
        }
        self.bar.finish();
    }
}

/// A [`Progress`] of `len` with `template` (see there for where it goes).
pub fn progress_bar(len: u64, forced: bool, template: &str) -> Progress {
    use std::io::IsTerminal;
    let terminal = std::io::stderr().is_terminal();
    if !forced && !terminal {
        return Progress::hidden();
    }
    let (bar, lines) = if terminal {
        (indicatif::ProgressBar::new(len), None)
    } else {
        let lines = std::sync::Arc::new(LineState::default());
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(len),
            indicatif::ProgressDrawTarget::term_like_with_hz(Box::new(LineTerm(lines.clone())), 1),
        );
        (bar, Some(lines))
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(template)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Progress { bar, lines }
}

/// Standard error as a terminal that cannot move its cursor: a draw a
/// second at most, each a new line (every draw once unthrottled).
#[derive(Debug)]
struct LineTerm(std::sync::Arc<LineState>);

/// What a [`LineTerm`] and its [`Progress`] share.
#[derive(Debug, Default)]
struct LineState {
    last: std::sync::Mutex<Option<std::time::Instant>>,
    unthrottled: std::sync::atomic::AtomicBool,
}

impl LineState {
    fn unthrottle(&self) {
        self.unthrottled
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl indicatif::TermLike for LineTerm {
    fn width(&self) -> u16 {
        100
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.write_str(s)
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        use std::io::Write;
        // Each draw a line of its own (the padding that would overwrite
        // the previous one in place dropped).
        let line = s.trim_end();
        {
            // Not held across the write.
            let mut last = self
                .0
                .last
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let throttled = !self
                .0
                .unthrottled
                .load(std::sync::atomic::Ordering::Relaxed)
                && last.is_some_and(|t| t.elapsed().as_millis() < 1000);
            if line.is_empty() || throttled {
                return Ok(());
            }
            *last = Some(std::time::Instant::now());
        }
        writeln!(std::io::stderr().lock(), "{line}")
    }
    fn clear_line(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        use std::io::Write;
        std::io::stderr().flush()
    }
}
