//! Admission to a kind of device's slots: which waiting evaluation gets the next free slot, and where.
//!
//! Waiting evaluations are served by priority (higher first) and, within a priority, in turns across jobs
//! (`job_id`): a job that queued a hundred evaluations does not make a job that queued one wait for all of them.
//!
//! Memory-aware admission: each GPU may have a memory budget (its total memory times `gpu_memory_fraction`), and
//! an evaluation whose footprint is known (from its task's reference: [`footprint`]) reserves that many bytes of it
//! while it holds a slot. A waiter is handed a slot only on a device where its footprint fits beside what is
//! reserved there, or where nothing is reserved (a task larger than the budget runs without other known-footprint
//! evaluations rather than never). An evaluation whose footprint is unknown is admitted by slots alone. The queue
//! stays in order: the first waiter is served when it fits, and while it does not, nobody behind it is served
//! (head-of-line waiting), so small evaluations cannot keep a large one waiting forever.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::oneshot;

/// How many bytes of device memory an evaluation needs, from the peak its task's reference allocated on the device
/// (`torch.cuda.max_memory_allocated` after the reference trials): the candidate's process holds the same inputs
/// and outputs and a workspace of its own, and the checker holds the reference's outputs beside the candidate's,
/// hence twice the peak; plus 1 GiB that the allocator does not see or that the harness adds: the CUDA context
/// (300-500 MB), the first gigabyte of free memory the candidate stage fills with NaN before it starts, and the
/// extra timing input sets of small tasks; and the copies of sampled timed calls' outputs the timed loop holds (at
/// most `disk::SAMPLED_TIMED_BYTES`).
pub fn footprint(reference_peak_bytes: u64) -> u64 {
    const FACTOR: u64 = 2;
    const OVERHEAD: u64 = (1 << 30) + crate::disk::SAMPLED_TIMED_BYTES;
    reference_peak_bytes.saturating_mul(FACTOR).saturating_add(OVERHEAD)
}

/// Where a waiter stands: priority (higher first), its job's turn, arrival.
pub(super) type Turn = (Reverse<i32>, u64, u64);

/// A slot handed out: its device, the bytes reserved there for the evaluation, and the device's quarantine count
/// at the time (a slot taken before a quarantine does not go back to the pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Grant {
    pub(super) index: usize,
    pub(super) bytes: u64,
    generation: u64,
}

/// An evaluation waiting for a slot.
#[derive(Debug)]
pub(super) struct Waiter {
    sender: oneshot::Sender<Grant>,
    /// Its footprint in bytes, where known.
    footprint: Option<u64>,
}

/// Slots of one kind of device and the evaluations waiting for them.
#[derive(Debug, Default)]
pub(super) struct Pool {
    /// Free slots of devices in service, by device index (a device appears once per free slot).
    free: Vec<usize>,
    /// Devices in service (not quarantined).
    pub(super) in_service: usize,
    /// Per device: its memory budget in bytes; `None`: admitted by slots alone (the CPU, a GPU whose memory is
    /// unknown, or admission by memory turned off).
    budgets: Vec<Option<u64>>,
    /// Per device: the bytes reserved by the evaluations holding its slots.
    pub(super) reserved: Vec<u64>,
    /// Per device: the reserved bytes as a metric (none for the CPU).
    gauges: Vec<Gauge>,
    /// Per device: how many times it was quarantined, and whether it is now.
    generation: Vec<u64>,
    quarantined: Vec<bool>,
    pub(super) waiters: BTreeMap<Turn, Waiter>,
    /// Per job: the turn its next waiter gets.
    next_turn: HashMap<String, u64>,
    /// The turn of the waiter served last; a job that starts waiting starts here.
    serving: u64,
    arrivals: u64,
}

impl Pool {
    /// Devices with these budgets, `slots` slots each.
    pub(super) fn new(budgets: Vec<Option<u64>>, slots: usize, gauges: Vec<Gauge>) -> Self {
        let devices = budgets.len();
        let free = (0..slots).flat_map(|_| (0..devices).rev()).collect();
        Self {
            free,
            in_service: devices,
            budgets,
            reserved: vec![0; devices],
            gauges,
            generation: vec![0; devices],
            quarantined: vec![false; devices],
            ..Self::default()
        }
    }

    /// Whether an evaluation of `footprint` may join device `index` now: it fits beside what is reserved there,
    /// or nothing is. Without a budget or a footprint, always.
    fn fits(&self, index: usize, footprint: Option<u64>) -> bool {
        match (self.budgets[index], footprint) {
            (Some(budget), Some(bytes)) => {
                let reserved = self.reserved[index];
                reserved == 0 || reserved.saturating_add(bytes) <= budget
            }
            _ => true,
        }
    }

    /// Takes a free slot where `footprint` fits (the last freed first), reserving it there.
    pub(super) fn take(&mut self, footprint: Option<u64>) -> Option<Grant> {
        let at = self.free.iter().rposition(|&index| self.fits(index, footprint))?;
        let index = self.free.remove(at);
        let bytes = if self.budgets[index].is_some() { footprint.unwrap_or(0) } else { 0 };
        self.reserve(index, self.reserved[index].saturating_add(bytes));
        Some(Grant { index, bytes, generation: self.generation[index] })
    }

    fn reserve(&mut self, index: usize, bytes: u64) {
        self.reserved[index] = bytes;
        if let Some(gauge) = self.gauges.get(index) {
            gauge.set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }

    /// Puts a slot and its bytes back, unless its device was quarantined since it was taken.
    pub(super) fn give_back(&mut self, grant: Grant) {
        let Grant { index, bytes, generation } = grant;
        if self.quarantined[index] || self.generation[index] != generation {
            return;
        }
        self.reserve(index, self.reserved[index].saturating_sub(bytes));
        self.free.push(index);
    }

    /// Gives a slot back and serves the waiters that now fit.
    pub(super) fn release(&mut self, grant: Grant) {
        self.give_back(grant);
        self.serve();
    }

    /// Hands free slots to waiters in order while the first one fits; one that does not keeps the others waiting
    /// behind it (head-of-line), so that it is served once enough is released. Waiters that went away are skipped.
    pub(super) fn serve(&mut self) {
        while let Some((&place, first)) = self.waiters.first_key_value() {
            if first.sender.is_closed() {
                self.waiters.remove(&place);
                continue;
            }
            let Some(grant) = self.take(first.footprint) else { return };
            let waiter = self.waiters.remove(&place).expect("the first waiter");
            let (_, turn, _) = place;
            self.serving = self.serving.max(turn);
            if let Err(grant) = waiter.sender.send(grant) {
                self.give_back(grant);
            }
        }
    }

    /// Queues a waiter of `job` at `priority` in its turn; returns its place and where its slot will come.
    pub(super) fn enqueue(
        &mut self,
        priority: i32,
        job: &str,
        footprint: Option<u64>,
    ) -> (Turn, oneshot::Receiver<Grant>) {
        let turn = self.serving.max(self.next_turn.get(job).copied().unwrap_or(0));
        self.next_turn.insert(job.to_owned(), turn + 1);
        let arrival = self.arrivals;
        self.arrivals += 1;
        let (sender, receiver) = oneshot::channel();
        let place = (Reverse(priority), turn, arrival);
        self.waiters.insert(place, Waiter { sender, footprint });
        (place, receiver)
    }

    /// Takes device `index` out of service: its free slots leave the pool, and its slots in use and their bytes
    /// do not come back.
    pub(super) fn quarantine(&mut self, index: usize) {
        self.free.retain(|&free| free != index);
        self.quarantined[index] = true;
        self.generation[index] += 1;
        self.reserve(index, 0);
        self.in_service -= 1;
        if self.in_service == 0 {
            // Nothing will serve them: every waiter gets its error now.
            self.waiters.clear();
        }
    }

    /// Puts device `index` back in service with `slots` free slots, and serves the waiters that fit.
    pub(super) fn restore(&mut self, index: usize, slots: usize) {
        self.quarantined[index] = false;
        self.in_service += 1;
        self.reserve(index, 0);
        self.free.extend(std::iter::repeat_n(index, slots));
        self.serve();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The pool is driven step by step: a waiter's channel says whether it was served, so nothing depends on timing.

    const GIB: u64 = 1 << 30;

    /// A pool of `devices` GPUs with a budget of `budget_gib` GiB each and `slots` slots each.
    fn memory_pool(devices: usize, budget_gib: u64, slots: usize) -> Pool {
        Pool::new(vec![Some(budget_gib * GIB); devices], slots, Vec::new())
    }

    fn served(receiver: &mut oneshot::Receiver<Grant>) -> Option<Grant> {
        receiver.try_recv().ok()
    }

    #[test]
    fn footprints_are_twice_the_reference_peak_and_a_gigabyte() {
        assert_eq!(footprint(0), 2 * GIB);
        assert_eq!(footprint(3 * GIB), 8 * GIB);
        assert_eq!(footprint(u64::MAX), u64::MAX, "saturates");
    }

    #[test]
    fn a_footprint_is_admitted_only_where_it_fits_and_unknown_ones_by_slots() {
        let mut pool = memory_pool(1, 10, 4);
        let first = pool.take(Some(6 * GIB)).expect("fits an empty device");
        assert_eq!((first.index, first.bytes), (0, 6 * GIB));
        assert_eq!(pool.take(Some(5 * GIB)), None, "6 + 5 GiB is over the 10 GiB budget, with slots free");
        let second = pool.take(Some(4 * GIB)).expect("6 + 4 GiB fits");
        assert_eq!(pool.reserved, [10 * GIB]);
        let unknown = pool.take(None).expect("an unknown footprint needs only a slot");
        assert_eq!(unknown.bytes, 0);
        assert_eq!(pool.reserved, [10 * GIB]);
        assert!(pool.take(None).is_some(), "the last slot");
        assert_eq!(pool.take(None), None, "no slot left");
        pool.release(first);
        assert_eq!(pool.reserved, [4 * GIB]);
        assert!(pool.take(Some(6 * GIB)).is_some(), "fits again once released");
        pool.release(second);
        pool.release(unknown);
        assert_eq!(pool.reserved, [6 * GIB]);
    }

    #[test]
    fn a_footprint_goes_to_a_gpu_where_it_fits() {
        let mut pool = memory_pool(2, 10, 4);
        let a = pool.take(Some(6 * GIB)).expect("a GPU");
        let b = pool.take(Some(6 * GIB)).expect("the other GPU");
        assert_ne!(a.index, b.index, "6 + 6 GiB does not fit on one");
        assert_eq!(pool.take(Some(6 * GIB)), None);
        let small = pool.take(Some(4 * GIB)).expect("4 GiB fits beside either");
        assert_eq!(pool.reserved.iter().sum::<u64>(), 16 * GIB);
        assert!([a.index, b.index].contains(&small.index));
    }

    #[test]
    fn the_first_waiter_waits_for_memory_holds_those_behind_it_and_is_served_on_release() {
        let mut pool = memory_pool(1, 10, 4);
        let held = pool.take(Some(6 * GIB)).expect("fits");
        let (_, mut large) = pool.enqueue(0, "a", Some(6 * GIB));
        pool.serve();
        assert_eq!(served(&mut large), None, "6 + 6 GiB does not fit");
        let (_, mut small) = pool.enqueue(0, "b", Some(GIB));
        pool.serve();
        assert_eq!(served(&mut small), None, "it would fit, but waits behind the first waiter (head-of-line)");
        pool.release(held);
        let large = served(&mut large).expect("served once the memory was released");
        let small = served(&mut small).expect("and the one behind it, which fits beside it");
        assert_eq!((large.bytes, small.bytes), (6 * GIB, GIB));
        assert_eq!(pool.reserved, [7 * GIB]);
        assert!(pool.waiters.is_empty());
    }

    #[test]
    fn a_footprint_over_the_budget_runs_without_other_reservations_rather_than_never() {
        let mut pool = memory_pool(1, 10, 4);
        let held = pool.take(Some(3 * GIB)).expect("fits");
        let (_, mut huge) = pool.enqueue(0, "", Some(20 * GIB));
        pool.serve();
        assert_eq!(served(&mut huge), None, "it waits for the device's reservations to end");
        pool.release(held);
        let huge = served(&mut huge).expect("nothing reserved: admitted although over the budget");
        assert_eq!(pool.reserved, [20 * GIB]);
        assert_eq!(pool.take(Some(GIB)), None, "nothing with a known footprint joins it");
        assert!(pool.take(None).is_some(), "an unknown footprint is admitted by slots (the OOM retry covers it)");
        pool.release(huge);
        assert_eq!(pool.reserved, [0]);
    }

    #[test]
    fn memory_waits_keep_priority_then_turns_across_jobs() {
        let mut pool = memory_pool(1, 10, 4);
        let held = pool.take(Some(6 * GIB)).expect("fits");
        // Each needs 6 GiB: one at a time.
        let (_, mut a1) = pool.enqueue(0, "a", Some(6 * GIB));
        let (_, mut a2) = pool.enqueue(0, "a", Some(6 * GIB));
        let (_, mut b1) = pool.enqueue(0, "b", Some(6 * GIB));
        let (_, mut urgent) = pool.enqueue(5, "c", Some(6 * GIB));
        pool.serve();
        let mut order = Vec::new();
        let mut grant = held;
        for _ in 0..4 {
            pool.release(grant);
            let next = [("a1", &mut a1), ("a2", &mut a2), ("b1", &mut b1), ("urgent", &mut urgent)]
                .into_iter()
                .filter_map(|(label, receiver)| served(receiver).map(|grant| (label, grant)))
                .collect::<Vec<_>>();
            assert_eq!(next.len(), 1, "one at a time: {next:?}");
            order.push(next[0].0);
            grant = next[0].1;
        }
        assert_eq!(order, ["urgent", "a1", "b1", "a2"]);
    }
}
