//! What the engine learns of each task as it runs: the seeds its runs use, its reference's peak device memory (a
//! run's footprint for memory-aware admission) and its reference's eager median per call (what a profile's call
//! limits scale with).

use std::hash::BuildHasher;

use super::Engine;
use crate::devices;

impl Engine {
    /// Seeds the candidate cannot know in advance: derived from a secret drawn when this engine started, so they
    /// repeat per task and `purpose` (and the reference cache hits) but differ between engine instances.
    pub fn seeds(&self, task_key: &str, purpose: &str, count: usize) -> Vec<u64> {
        let hasher = std::hash::BuildHasherDefault::<std::hash::DefaultHasher>::default();
        (0..count).map(|i| hasher.hash_one((self.inner.secret, task_key, purpose, i)) % (1 << 31)).collect()
    }

    /// The device memory a run of the task needs on a GPU, from its reference's measured peak
    /// (`devices::footprint`); `None` until the task's reference has run on a GPU in this engine (or its cache
    /// entry recorded the peak). With GPUs of several kinds, the largest known.
    pub fn footprint(&self, task_key: &str) -> Option<u64> {
        self.reference_peak(task_key).map(devices::footprint)
    }

    /// The largest reference peak device memory known for the task on any of this engine's GPUs.
    pub fn reference_peak(&self, task_key: &str) -> Option<u64> {
        let python = self.inner.python.as_ref().ok()?;
        let peaks = self.inner.reference_peaks.lock().expect("never poisoned");
        let known = python.gpus.iter().filter_map(|gpu| peaks.get(&(task_key.to_owned(), gpu.name.clone())));
        known.copied().max()
    }

    /// Keeps the task's reference peak device memory on `device` (by name).
    pub fn note_reference_peak(&self, task_key: &str, device: &str, peak: u64) {
        let mut peaks = self.inner.reference_peaks.lock().expect("never poisoned");
        peaks.insert((task_key.to_owned(), device.to_owned()), peak);
    }

    /// The task's reference eager median per call on `gpu` (or the CPU), as the latest baseline said.
    pub fn eager_median_ms(&self, task_key: &str, gpu: Option<usize>) -> Option<f64> {
        let device = self.inner.python.as_ref().ok()?.device_name(gpu).to_owned();
        self.inner.eager_medians.lock().expect("never poisoned").get(&(task_key.to_owned(), device)).copied()
    }

    /// Keeps the task's reference eager median per call on `gpu` (or the CPU).
    pub fn note_eager_median(&self, task_key: &str, gpu: Option<usize>, median_ms: f64) {
        let Ok(python) = self.inner.python.as_ref() else { return };
        let key = (task_key.to_owned(), python.device_name(gpu).to_owned());
        self.inner.eager_medians.lock().expect("never poisoned").insert(key, median_ms);
    }
}
