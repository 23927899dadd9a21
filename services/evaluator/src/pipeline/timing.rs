//! Timing, pure: the candidate's samples and the timed calls it kept checked, the wall-clock cross-check against the
//! baseline's overhead, and the notice of a median that includes launch time (the speedups are `record.rs`'s).

use kforge_execution::Finding;
use kforge_execution::disk::SAMPLED_TIMED_CALLS;
use kforge_execution::protocol::{CandidateResult, TimedOutput, TimingCpu};

use super::baseline::Baseline;
use crate::stats::timing_stats;

/// A candidate's timing samples: by the events (or the clock on a CPU) and by the host clock.
#[derive(Debug, Clone)]
pub(super) struct Measured {
    pub(super) events: Vec<f64>,
    pub(super) host: Vec<f64>,
}

/// The samples of a candidate run, or the finding that they are impossible.
pub(super) fn timing_samples(result: &CandidateResult) -> Result<Measured, Finding> {
    let (events, host) = (result.samples_ms.clone(), result.host_ms.clone());
    let valid = |s: &[f64]| !s.is_empty() && s.iter().all(|v| v.is_finite() && *v > 0.0);
    if !valid(&events) || !valid(&host) || events.len() != host.len() {
        return Err(Finding::hack(
            "timing.impossible",
            format!(
                "{} timing samples and {} host-clock samples: empty, unequal, negative or not finite",
                events.len(),
                host.len()
            ),
        ));
    }
    Ok(Measured { events, host })
}

/// The timed calls whose outputs the candidate's harness saved for the checker: the last, then the sampled ones
/// (earlier, distinct, at most SAMPLED_TIMED_CALLS), or the finding that the harness reported what it cannot have
/// done (timing samples and no timed call kept among them).
pub(super) fn timed_outputs(result: &CandidateResult) -> Result<Vec<TimedOutput>, Finding> {
    let kept = &result.timed_outputs;
    let Some(last) = kept.first().map(|k| k.call) else {
        return match result.samples_ms.is_empty() {
            true => Ok(vec![]),
            false => Err(Finding::hack("timing.impossible", "timing samples and no timed call's outputs kept")),
        };
    };
    let mut sampled: Vec<i64> = kept[1..].iter().map(|k| k.call).collect();
    sampled.sort_unstable();
    sampled.dedup();
    let valid = last >= 0
        && sampled.len() == kept.len() - 1
        && sampled.len() as u64 <= SAMPLED_TIMED_CALLS
        && sampled.iter().all(|call| (0..last).contains(call));
    if !valid {
        let calls: Vec<i64> = kept.iter().map(|k| k.call).collect();
        return Err(Finding::hack(
            "timing.impossible",
            format!("timed calls {calls:?} kept: not the last then earlier ones"),
        ));
    }
    Ok(kept.clone())
}

/// Unaccounted wall-clock time per timed call must stay under this (ms), or half the candidate's median if larger.
pub(super) const WALL_CLOCK_SLACK_MS: f64 = 0.25;

/// The parent's wall-clock cross-check: a candidate whose timed steps take much longer on the host clock than its
/// events say (beyond the overhead the clean baseline shows) did work, or waited, where the events cannot see.
pub(super) fn wall_clock_mismatch(measured: &Measured, baseline: &Baseline) -> Option<Finding> {
    let base_host = baseline.eager_host.as_deref()?;
    let hidden = crate::stats::unaccounted_host_ms((&measured.events, &measured.host), (&baseline.eager, base_host))?;
    let median = timing_stats(measured.events.clone())?.median_ms;
    (hidden > WALL_CLOCK_SLACK_MS.max(0.5 * median)).then(|| {
        Finding::hack(
            "timing.wall_clock_mismatch",
            format!(
                "each timed call took {hidden:.3} ms more on the host clock than its timer reported ({median:.3} ms \
                 median), beyond the reference's overhead: work was done where the timer could not see it"
            ),
        )
    })
}

/// The notice for a candidate whose timed calls were mostly enqueued after the device had reached their start: the
/// host's launch took longer than the flush and the cover could hide (capped at the call's device time plus the
/// flush's plus 50 us, so that work moved onto the host is paid for), and the median includes launch time. Calls of
/// a few microseconds with a slow launch get it; a reward built on their speedup should know.
pub(super) fn launch_exposed(cpu: &TimingCpu) -> Option<Finding> {
    let share = cpu.cover_short_share.filter(|share| *share > 0.5)?;
    let us = |ms: Option<f64>| ms.map_or_else(|| "?".to_owned(), |ms| format!("{:.1}", ms * 1000.0));
    Some(Finding::notice(
        "timing.launch_exposed",
        format!(
            "in {:.0}% of the timed calls the device reached the call's start before the host had launched it \
             (launch {} us, cover {} us, medians): the median includes the host's launch time beyond the cover",
            share * 100.0,
            us(cpu.launch_ms),
            us(cpu.cover_device_ms)
        ),
    ))
}

#[cfg(test)]
mod tests {
    use kforge_static_checks::Category;

    use super::*;

    fn samples(events: &[f64], host: &[f64]) -> CandidateResult {
        CandidateResult { samples_ms: events.to_vec(), host_ms: host.to_vec(), ..CandidateResult::default() }
    }

    #[test]
    fn impossible_samples_are_a_hack() {
        let cases: [(&[f64], &[f64]); 5] = [
            (&[], &[]),
            (&[1.0, 2.0], &[1.0]),
            (&[1.0, -2.0], &[1.0, 2.0]),
            (&[1.0, 0.0], &[1.0, 2.0]),
            (&[1.0, f64::INFINITY], &[1.0, 2.0]),
        ];
        for (events, host) in cases {
            let finding = timing_samples(&samples(events, host)).expect_err("impossible");
            assert_eq!(finding.code, "timing.impossible", "{events:?} {host:?}");
            assert_eq!(finding.category, Category::Hack);
        }
        let measured = timing_samples(&samples(&[1.0, 2.0], &[1.1, 2.1])).expect("possible");
        assert_eq!((measured.events, measured.host), (vec![1.0, 2.0], vec![1.1, 2.1]));
    }

    #[test]
    fn the_timed_calls_checked_are_the_last_and_the_sampled_ones() {
        let kept = |calls: &[i64]| -> Vec<TimedOutput> {
            calls.iter().map(|&call| TimedOutput { call, digest: vec![call, 1] }).collect()
        };
        let result = |calls: &[i64]| CandidateResult {
            samples_ms: vec![1.0],
            timed_outputs: kept(calls),
            ..CandidateResult::default()
        };
        assert_eq!(timed_outputs(&result(&[40, 31, 5, 17])), Ok(kept(&[40, 31, 5, 17])));
        assert_eq!(timed_outputs(&result(&[0])), Ok(kept(&[0])));
        assert_eq!(timed_outputs(&CandidateResult::default()), Ok(vec![]), "not timed");
        let forged: [&[i64]; 6] = [&[], &[-1], &[40, 40], &[40, 3, 3], &[40, -2], &[40, 1, 2, 3, 4, 5]];
        for calls in forged {
            let finding = timed_outputs(&result(calls)).expect_err("impossible");
            assert_eq!(finding.code, "timing.impossible", "{calls:?}");
        }
    }

    fn baseline(gap_ms: Option<f64>) -> Baseline {
        let eager = vec![10.0; 5];
        Baseline { eager_host: gap_ms.map(|gap| eager.iter().map(|e| e + gap).collect()), eager, compiled: None }
    }

    #[test]
    fn the_wall_clock_cross_check_allows_the_baselines_overhead_and_slack() {
        let measured = |gap: f64| Measured { events: vec![1.0; 5], host: vec![1.0 + gap; 5] };
        // The reference's own overhead of 0.2 ms per step is allowed; half the median (0.5 ms) is the slack here.
        assert!(wall_clock_mismatch(&measured(0.6), &baseline(Some(0.2))).is_none());
        let finding = wall_clock_mismatch(&measured(0.8), &baseline(Some(0.2))).expect("0.6 ms hidden per call");
        assert_eq!(finding.code, "timing.wall_clock_mismatch");
        assert!(finding.message.contains("0.600 ms more"), "{}", finding.message);
        // The slack is at least WALL_CLOCK_SLACK_MS for short calls.
        let short = Measured { events: vec![0.01; 5], host: vec![0.01 + 0.2; 5] };
        assert!(wall_clock_mismatch(&short, &baseline(Some(0.0))).is_none());
        // A baseline cached before the host clock was recorded cannot tell.
        assert!(wall_clock_mismatch(&measured(100.0), &baseline(None)).is_none());
    }

    #[test]
    fn a_median_that_includes_launch_time_is_named() {
        let cpu = |share| TimingCpu {
            launch_ms: Some(0.1),
            cover_device_ms: Some(0.06),
            cover_short_share: share,
            ..TimingCpu::default()
        };
        for quiet in [None, Some(0.0), Some(0.5)] {
            assert!(launch_exposed(&cpu(quiet)).is_none(), "{quiet:?}: the median is a call the cover hid");
        }
        let finding = launch_exposed(&cpu(Some(0.75))).expect("three calls in four exposed");
        assert_eq!(finding.code, "timing.launch_exposed");
        assert_eq!(finding.category, Category::Notice);
        assert!(
            finding.message.contains("75%") && finding.message.contains("launch 100.0 us, cover 60.0 us"),
            "{}",
            finding.message
        );
    }
}
