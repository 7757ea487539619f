//! The machine's own latency, measured beside a load: a thread that
//! sleeps 1 ms at a time, at real-time priority where allowed
//! (`SCHED_FIFO`), and records how late each wake-up comes. A real-time
//! thread runs as soon as it wakes unless the kernel or the hypervisor
//! holds its CPU, so its lateness is a floor under any request's latency
//! on the machine at that moment: what a tail benchmark's figures cannot
//! go below, whatever the server does.

use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;

/// Arguments of `sqcow2-bench wakeup-latency`.
#[derive(Debug, clap::Args)]
pub struct WakeupArgs {
    /// How long to measure, in seconds.
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// The sleep between wake-ups, in microseconds.
    #[arg(long, default_value_t = 1000)]
    period_us: u64,
    #[arg(long, value_enum, default_value_t = crate::OutputFormat::Human)]
    output: crate::OutputFormat,
}

/// What the probe saw.
#[derive(Debug, Serialize)]
struct WakeupReport {
    /// Whether the thread ran at real-time priority (else at the default
    /// policy, which measures the scheduler's queueing too).
    realtime: bool,
    wakeups: u64,
    /// Lateness percentiles and maximum, in microseconds.
    late_p50_us: u64,
    late_p99_us: u64,
    late_max_us: u64,
    /// Wake-ups later than 1 ms and than 5 ms.
    late_over_1ms: u64,
    late_over_5ms: u64,
}

/// Raises the calling thread to `SCHED_FIFO` (priority 50); whether it
/// could.
fn raise() -> bool {
    let param = libc::sched_param { sched_priority: 50 };
    // SAFETY: sets the calling thread's policy from a valid parameter
    // block that lives across the call; no memory is kept.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) == 0 }
}

pub fn run_cli(args: &WakeupArgs) -> Result<()> {
    let period = Duration::from_micros(args.period_us.max(1));
    let duration = Duration::from_secs_f64(args.duration.max(0.0));
    let report = std::thread::spawn(move || measure(period, duration))
        .join()
        .map_err(|_| anyhow::anyhow!("the probe thread panicked"))?;
    match args.output {
        crate::OutputFormat::Json => println!("{}", serde_json::to_string(&report)?),
        crate::OutputFormat::Human => println!(
            "{} wake-ups every {} us ({}): late p50 {} us, p99 {} us, max {} us; over 1 ms {}, over 5 ms {}",
            report.wakeups,
            period.as_micros(),
            if report.realtime { "SCHED_FIFO" } else { "normal priority" },
            report.late_p50_us,
            report.late_p99_us,
            report.late_max_us,
            report.late_over_1ms,
            report.late_over_5ms
        ),
    }
    Ok(())
}

fn measure(period: Duration, duration: Duration) -> WakeupReport {
    let realtime = raise();
    let start = Instant::now();
    let mut late: Vec<u64> = Vec::new();
    while start.elapsed() < duration {
        let before = Instant::now();
        std::thread::sleep(period);
        let slept = before.elapsed();
        late.push(slept.saturating_sub(period).as_micros() as u64);
    }
    late.sort_unstable();
    let pct = |p: f64| {
        late.get(((late.len() as f64 * p) as usize).min(late.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    WakeupReport {
        realtime,
        wakeups: late.len() as u64,
        late_p50_us: pct(0.5),
        late_p99_us: pct(0.99),
        late_max_us: late.last().copied().unwrap_or(0),
        late_over_1ms: late.iter().filter(|l| **l > 1000).count() as u64,
        late_over_5ms: late.iter().filter(|l| **l > 5000).count() as u64,
    }
}
