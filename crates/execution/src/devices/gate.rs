//! The gate of one device: how the evaluations holding slots on it share it without touching each other's
//! timings. Their processes use the device side by side, except that timed work (timing loops, the census's
//! recorded calls) runs alone: it starts only once every other process on the device has reached a synchronised
//! pause point and been stopped (`SIGSTOP`), and no process joins or resumes until it is over. With one slot, an
//! evaluation has its device to itself.
//!
//! Times are read from tokio's clock (the system's steady clock, never set back, but for tests that pause it).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// Who is using one device, and how. Members (stage processes) share the device, except that one at a time may
/// run alone: it is let through once every other member stands at a pause point (or is idle), and until it shares
/// again no member joins or resumes. A member waiting at a pause point is stopped by its driver (`SIGSTOP`) after
/// synchronising its device work, so a member running alone has the device to itself. A solo member (an
/// evaluation retried without neighbours) joins only an empty device and keeps it empty.
///
/// A trusted stage (one that runs no candidate code: the reference, the checker, the baseline) may join idle: it
/// does host work without holding anyone up, and asks to share before it touches the device.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    /// Bumped on every change of `state`; waiters re-check their condition.
    changed: watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct GateState {
    next_id: u64,
    members: BTreeMap<u64, Standing>,
    /// Members waiting to run alone, first asked first.
    queue: VecDeque<u64>,
    alone: Option<u64>,
    solo: Option<u64>,
    /// Where the device's time went until `since`.
    account: GateAccount,
    since: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// Running, and may be using the device.
    Sharing,
    /// At a pause point with its device work synchronised (stopped by its driver).
    Paused,
    /// Running with the device to itself.
    Alone,
    /// A trusted stage doing host work only.
    Idle,
}

/// Where one device's time went, by what its gate was doing.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct GateAccount {
    /// A member ran alone.
    pub alone: Duration,
    /// A member waited to run alone while others finished their shared work: the device drained.
    pub draining: Duration,
    /// Members shared the device.
    pub shared: Duration,
    /// No member.
    pub empty: Duration,
}

impl GateState {
    /// Whether someone runs alone or waits to: pause points pause.
    fn pausing(&self) -> bool {
        self.alone.is_some() || !self.queue.is_empty()
    }

    /// Whether a member may start (or resume) using the device side by side with others.
    fn open(&self) -> bool {
        self.alone.is_none() && self.queue.is_empty() && self.solo.is_none()
    }

    /// Books the time since the last change to what the gate was doing during it.
    fn book(&mut self) {
        let now = Instant::now();
        let elapsed = self.since.map_or(Duration::ZERO, |since| now - since);
        self.since = Some(now);
        let bucket = if self.alone.is_some() {
            &mut self.account.alone
        } else if !self.queue.is_empty() {
            &mut self.account.draining
        } else if self.members.is_empty() {
            &mut self.account.empty
        } else {
            &mut self.account.shared
        };
        *bucket += elapsed;
    }
}

/// A member of a [`Gate`]; leaves it when dropped.
#[derive(Debug)]
pub struct Member {
    gate: Arc<Gate>,
    id: u64,
    /// May go idle (a trusted stage).
    trusted: bool,
    clock: MemberClock,
}

/// How long one member ran alone and waited at its gate.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct MemberTimes {
    pub alone: Duration,
    pub waited: Duration,
}

/// A member's [`MemberTimes`] as they accrue; a handle that outlives the member.
#[derive(Debug, Clone, Default)]
pub struct MemberClock(Arc<Mutex<Clock>>);

#[derive(Debug, Default)]
struct Clock {
    times: MemberTimes,
    alone_since: Option<Instant>,
}

impl MemberClock {
    /// The times so far (a member running alone now counts up to its last change).
    pub fn times(&self) -> MemberTimes {
        self.lock().times
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Clock> {
        self.0.lock().expect("never poisoned")
    }

    fn end_alone(&self) {
        let mut clock = self.lock();
        if let Some(since) = clock.alone_since.take() {
            clock.times.alone += since.elapsed();
        }
    }
}

impl Gate {
    /// Joins the device, waiting while a member runs alone or waits to (timed work is never disturbed by a
    /// newcomer). A `solo` member waits for an empty device and keeps everyone else out.
    pub async fn join(self: &Arc<Self>, solo: bool) -> Member {
        let id = self
            .wait_until(|state| {
                if !state.open() || (solo && !state.members.is_empty()) {
                    return None;
                }
                let id = state.next_id;
                state.next_id += 1;
                state.members.insert(id, Standing::Sharing);
                if solo {
                    state.solo = Some(id);
                }
                Some(id)
            })
            .await;
        Member { gate: self.clone(), id, trusted: false, clock: MemberClock::default() }
    }

    /// Joins idle, at once: a trusted stage that asks to share before it uses the device (and may go idle again).
    pub fn join_idle(self: &Arc<Self>) -> Member {
        let mut id = 0;
        self.update(|state| {
            id = state.next_id;
            state.next_id += 1;
            state.members.insert(id, Standing::Idle);
        });
        Member { gate: self.clone(), id, trusted: true, clock: MemberClock::default() }
    }

    /// How many members the device has now.
    pub fn members(&self) -> usize {
        self.state.lock().expect("gate lock is never poisoned").members.len()
    }

    /// Where the device's time went since the gate was made.
    pub fn account(&self) -> GateAccount {
        let mut state = self.state.lock().expect("gate lock is never poisoned");
        state.book();
        state.account
    }

    /// Applies `step` under the lock until it returns `Some`, waiting for a change between tries.
    async fn wait_until<T>(&self, mut step: impl FnMut(&mut GateState) -> Option<T>) -> T {
        let mut changed = self.changed.subscribe();
        loop {
            {
                let mut state = self.state.lock().expect("gate lock is never poisoned");
                state.book();
                if let Some(value) = step(&mut state) {
                    drop(state);
                    self.changed.send_modify(|version| *version += 1);
                    return value;
                }
            }
            // The sender lives in `self`, so this never fails.
            let _ = changed.changed().await;
        }
    }

    fn update(&self, change: impl FnOnce(&mut GateState)) {
        {
            let mut state = self.state.lock().expect("gate lock is never poisoned");
            state.book();
            change(&mut state);
        }
        self.changed.send_modify(|version| *version += 1);
    }
}

impl Member {
    /// Waits at a pause point until this member may run alone: its turn among those asking, with every other
    /// member paused or idle. Runs alone already: nothing to wait for.
    pub async fn alone(&self) {
        let id = self.id;
        let asked = Instant::now();
        self.gate.update(|state| {
            if state.alone != Some(id) && !state.queue.contains(&id) {
                state.members.insert(id, Standing::Paused);
                state.queue.push_back(id);
            }
        });
        self.gate
            .wait_until(|state| {
                if state.alone == Some(id) {
                    return Some(());
                }
                let others_held = state
                    .members
                    .iter()
                    .all(|(&m, &standing)| m == id || matches!(standing, Standing::Paused | Standing::Idle));
                if state.alone.is_some() || state.queue.front() != Some(&id) || !others_held {
                    return None;
                }
                state.queue.pop_front();
                state.alone = Some(id);
                state.members.insert(id, Standing::Alone);
                Some(())
            })
            .await;
        let mut clock = self.clock.lock();
        clock.times.waited += asked.elapsed();
        clock.alone_since.get_or_insert_with(Instant::now);
    }

    /// Ends running alone (or any wait, or being idle), pausing until members may share the device again.
    pub async fn share(&self) {
        let id = self.id;
        let asked = Instant::now();
        self.stand(Standing::Paused);
        self.gate
            .wait_until(|state| {
                // A solo member has the device to itself anyway.
                (state.solo == Some(id) || state.open()).then(|| {
                    state.members.insert(id, Standing::Sharing);
                })
            })
            .await;
        self.clock.lock().times.waited += asked.elapsed();
    }

    /// Stands at a pause point (stopped by its driver, its device work synchronised) without asking for anything:
    /// others may run alone meanwhile. A paired stage waits for its round's turn so (`super::pairing`).
    pub fn hold(&self) {
        self.stand(Standing::Paused);
    }

    /// Whether a pause point should pause: someone runs alone or waits to.
    pub fn must_pause(&self) -> bool {
        self.gate.state.lock().expect("gate lock is never poisoned").pausing()
    }

    /// Goes idle (a trusted member only; `false` otherwise): host work only until it shares again.
    pub fn idle(&self) -> bool {
        if !self.trusted {
            return false;
        }
        self.stand(Standing::Idle);
        true
    }

    /// Leaves running alone or waiting to, standing as `standing`.
    fn stand(&self, standing: Standing) {
        let id = self.id;
        self.clock.end_alone();
        self.gate.update(|state| {
            if state.alone == Some(id) {
                state.alone = None;
            }
            state.queue.retain(|&m| m != id);
            state.members.insert(id, standing);
        });
    }

    /// This member's clock, readable after the member is gone.
    pub fn clock(&self) -> MemberClock {
        self.clock.clone()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let id = self.id;
        self.clock.end_alone();
        self.gate.update(|state| {
            state.members.remove(&id);
            state.queue.retain(|&m| m != id);
            if state.alone == Some(id) {
                state.alone = None;
            }
            if state.solo == Some(id) {
                state.solo = None;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Tokio's clock is paused in these tests: it moves only when every task is blocked, so a task that can make
    // progress always has before the clock moves, and a sleep measures exactly what it says.

    /// Whether `future` is still waiting once every other task has run as far as it can.
    async fn waits<T>(future: &mut tokio::task::JoinHandle<T>) -> bool {
        tokio::time::sleep(Duration::from_millis(30)).await;
        !future.is_finished()
    }

    async fn done<T>(future: tokio::task::JoinHandle<T>) -> T {
        tokio::time::timeout(Duration::from_secs(5), future).await.expect("in time").expect("task")
    }

    #[tokio::test(start_paused = true)]
    async fn timed_work_runs_alone_and_in_turn() {
        let gate = Arc::new(Gate::default());
        let a = Arc::new(gate.join(false).await);
        let b = Arc::new(gate.join(false).await);
        assert_eq!(gate.members(), 2, "members share the device");

        // A asks to run alone: it waits while B may be using the device.
        let mut a_alone = tokio::spawn({
            let a = a.clone();
            async move { a.alone().await }
        });
        assert!(waits(&mut a_alone).await, "B is still sharing");
        // A newcomer waits too: it must not start work under A's timing.
        let mut c_joins = tokio::spawn({
            let gate = gate.clone();
            async move { gate.join(false).await }
        });
        assert!(waits(&mut c_joins).await);
        // B reaches its own pause point: A goes first, B after it.
        let mut b_alone = tokio::spawn({
            let b = b.clone();
            async move { b.alone().await }
        });
        done(a_alone).await;
        assert!(waits(&mut b_alone).await, "one alone at a time");
        let mut a_shares = tokio::spawn({
            let a = a.clone();
            async move { a.share().await }
        });
        done(b_alone).await;
        assert!(waits(&mut a_shares).await, "nobody resumes while B runs alone");
        assert!(waits(&mut c_joins).await);
        b.share().await;
        done(a_shares).await;
        let c = done(c_joins).await;
        assert_eq!(gate.members(), 3);
        drop(c);
    }

    #[tokio::test(start_paused = true)]
    async fn a_member_that_leaves_lets_the_others_through() {
        let gate = Arc::new(Gate::default());
        let a = Arc::new(gate.join(false).await);
        let b = gate.join(false).await;
        let mut a_alone = tokio::spawn({
            let a = a.clone();
            async move { a.alone().await }
        });
        assert!(waits(&mut a_alone).await);
        drop(b); // its process ended, however it ended
        done(a_alone).await;
        // A member that ends while running alone reopens the device.
        drop(a);
        let newcomer = tokio::time::timeout(Duration::from_secs(5), gate.join(false)).await;
        assert!(newcomer.is_ok(), "the device is open again");
    }

    #[tokio::test(start_paused = true)]
    async fn idle_members_hold_nobody_up_and_pause_points_pause_only_for_timed_work() {
        let gate = Arc::new(Gate::default());
        let a = Arc::new(gate.join(false).await);
        let checker = gate.join_idle();
        assert!(!a.must_pause(), "nobody runs alone or waits to");
        // An idle member does not hold up timed work, and joins at once even while it runs.
        tokio::time::timeout(Duration::from_secs(5), a.alone()).await.expect("the idle checker holds nobody up");
        let late = gate.join_idle();
        assert_eq!(gate.members(), 3);
        // Sharing from idle waits while timed work runs.
        let mut checker_shares = tokio::spawn(async move {
            checker.share().await;
            checker
        });
        assert!(waits(&mut checker_shares).await, "timed work runs");
        let b = Arc::new(gate.join_idle());
        assert!(b.idle(), "a trusted member goes idle");
        a.share().await;
        let checker = done(checker_shares).await;

        // A sharing member at a pause point pauses only while someone asks to run alone.
        let mut a_alone = tokio::spawn({
            let a = a.clone();
            async move { a.alone().await }
        });
        assert!(waits(&mut a_alone).await, "the checker shares the device");
        assert!(checker.must_pause(), "someone waits to run alone");
        let mut checker_pauses = tokio::spawn(async move {
            checker.share().await;
            checker
        });
        done(a_alone).await;
        assert!(waits(&mut checker_pauses).await, "paused while A runs alone");
        a.share().await;
        let checker = done(checker_pauses).await;
        assert!(!checker.must_pause());
        drop((late, b, checker));

        // An untrusted member cannot go idle: only stages that run no candidate code may.
        assert!(!a.idle());
    }

    #[tokio::test(start_paused = true)]
    async fn the_gate_accounts_for_time_alone_draining_and_shared() {
        let gate = Arc::new(Gate::default());
        let a = Arc::new(gate.join(false).await);
        let b = gate.join(false).await;
        let step = Duration::from_millis(60);
        tokio::time::sleep(step).await; // shared
        let a_alone = tokio::spawn({
            let a = a.clone();
            async move { a.alone().await }
        });
        tokio::time::sleep(step).await; // draining: B has not paused
        let b = Arc::new(b);
        let b_alone = tokio::spawn({
            let b = b.clone();
            async move { b.alone().await } // B pauses, queued behind A
        });
        done(a_alone).await;
        tokio::time::sleep(step).await; // A alone
        let a_shares = tokio::spawn({
            let a = a.clone();
            async move { a.share().await }
        });
        done(b_alone).await; // B's turn
        b.share().await;
        done(a_shares).await;
        let times = a.clock().times();
        drop((a, b));
        let account = gate.account();
        // The clock moves only where the test sleeps: each step is booked to what the gate was doing during it.
        let expected = GateAccount { alone: step, draining: step, shared: step, empty: Duration::ZERO };
        assert_eq!(account, expected);
        assert_eq!(times, MemberTimes { alone: step, waited: step }, "A ran alone, and waited for B to pause");
    }

    #[tokio::test(start_paused = true)]
    async fn a_solo_member_has_the_device_to_itself() {
        let gate = Arc::new(Gate::default());
        let a = gate.join(false).await;
        let mut solo = tokio::spawn({
            let gate = gate.clone();
            async move { gate.join(true).await }
        });
        assert!(waits(&mut solo).await, "a solo member waits for an empty device");
        drop(a);
        let solo = done(solo).await;
        // Its own requests are granted at once; nobody else joins while it is there.
        solo.alone().await;
        solo.share().await;
        let mut other = tokio::spawn({
            let gate = gate.clone();
            async move { gate.join(false).await }
        });
        assert!(waits(&mut other).await);
        drop(solo);
        done(other).await;
    }
}
