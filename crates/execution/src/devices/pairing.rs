//! Paired timing: a candidate and its baseline (the reference, in a clean process of its own) time their calls in
//! rounds, by turns: one round of the candidate's, then one of the baseline's, and so on. Each round runs alone on
//! the device (`super::gate`), and the other side waits stopped at its next round, so the two alternate every few
//! tens of milliseconds and meet the same load: on a shared CPU, a second job's burst slows both sides of a pair of
//! rounds, and the ratio of the pair stays the kernel's.
//!
//! The candidate goes first: the baseline, started beside it, waits for the candidate's first round (the
//! candidate's correctness trials run meanwhile), so both time in one window. A side that leaves (its stage ended,
//! early or not) lets the other run its remaining rounds without waiting.

use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// Which side of a pair a stage times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Candidate,
    Baseline,
}

impl Side {
    fn index(self) -> usize {
        match self {
            Self::Candidate => 0,
            Self::Baseline => 1,
        }
    }

    fn other(self) -> Self {
        match self {
            Self::Candidate => Self::Baseline,
            Self::Baseline => Self::Candidate,
        }
    }
}

/// The turns of one candidate and its baseline.
#[derive(Debug)]
pub struct Pairing {
    state: Mutex<PairState>,
    /// Bumped on every change of `state`; a side waiting for its turn checks again.
    changed: watch::Sender<u64>,
}

#[derive(Debug)]
struct PairState {
    /// Whose round is next.
    next: Side,
    /// Per side: it left the pair.
    left: [bool; 2],
}

impl Pairing {
    /// A pair whose first round is the candidate's.
    pub fn new() -> Arc<Self> {
        let state = PairState { next: Side::Candidate, left: [false; 2] };
        Arc::new(Self { state: Mutex::new(state), changed: watch::Sender::new(0) })
    }

    /// `side`'s handle; the side leaves the pair when it is dropped.
    pub fn side(self: &Arc<Self>, side: Side) -> PairSide {
        PairSide { pairing: self.clone(), side }
    }

    fn update(&self, change: impl FnOnce(&mut PairState)) {
        change(&mut self.state.lock().expect("pair lock is never poisoned"));
        self.changed.send_modify(|version| *version += 1);
    }
}

/// One side of a [`Pairing`], held by the conversation of the stage that times it.
#[derive(Debug)]
pub struct PairSide {
    pairing: Arc<Pairing>,
    side: Side,
}

impl PairSide {
    pub fn side(&self) -> Side {
        self.side
    }

    /// Waits until this side's round is next, or the other side has left.
    pub async fn turn(&self) {
        let mut changed = self.pairing.changed.subscribe();
        loop {
            {
                let state = self.pairing.state.lock().expect("pair lock is never poisoned");
                if state.next == self.side || state.left[self.side.other().index()] {
                    return;
                }
            }
            // The sender lives in the pairing this side holds, so this never fails.
            let _ = changed.changed().await;
        }
    }

    /// Ends this side's round: the other side's is next.
    pub fn end_turn(&self) {
        let side = self.side;
        self.pairing.update(|state| {
            if state.next == side {
                state.next = side.other();
            }
        });
    }
}

impl Drop for PairSide {
    fn drop(&mut self) {
        let side = self.side;
        self.pairing.update(|state| state.left[side.index()] = true);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Whether `turn` is still waiting once every other task has run as far as it can.
    async fn waits(turn: &mut tokio::task::JoinHandle<()>) -> bool {
        tokio::time::sleep(Duration::from_millis(30)).await;
        !turn.is_finished()
    }

    fn wait_turn(side: &Arc<PairSide>) -> tokio::task::JoinHandle<()> {
        let side = side.clone();
        tokio::spawn(async move { side.turn().await })
    }

    #[tokio::test(start_paused = true)]
    async fn rounds_alternate_starting_with_the_candidate() {
        let pairing = Pairing::new();
        let candidate = Arc::new(pairing.side(Side::Candidate));
        let baseline = Arc::new(pairing.side(Side::Baseline));
        let mut first = wait_turn(&baseline);
        assert!(waits(&mut first).await, "the baseline waits for the candidate's first round");
        wait_turn(&candidate).await.expect("the candidate goes first");
        candidate.end_turn();
        first.await.expect("the baseline's round follows the candidate's");
        let mut again = wait_turn(&candidate);
        assert!(waits(&mut again).await, "the candidate waits while the baseline's round runs");
        baseline.end_turn();
        again.await.expect("then the candidate's second round");
        candidate.end_turn();
        candidate.end_turn(); // a second end of the same turn changes nothing
        wait_turn(&baseline).await.expect("the baseline's second round");
    }

    #[tokio::test(start_paused = true)]
    async fn a_side_that_leaves_lets_the_other_run_on() {
        let pairing = Pairing::new();
        let candidate = pairing.side(Side::Candidate);
        let baseline = Arc::new(pairing.side(Side::Baseline));
        let mut waiting = wait_turn(&baseline);
        assert!(waits(&mut waiting).await);
        drop(candidate);
        waiting.await.expect("the candidate's stage ended: the baseline times its rounds without waiting");
        baseline.end_turn();
        wait_turn(&baseline).await.expect("and every later round");
    }
}
