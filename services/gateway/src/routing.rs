//! Choosing a backend of a pool: least outstanding requests, power of two choices, and episode affinity by
//! consistent hashing with bounded load.
//!
//! The functions here see only each backend's load and whether it may take the request, so they are pure and
//! tested without a network. The hash is a fixed function (FNV-1a with a 64-bit finaliser), never a per-process
//! seeded one: every gateway replica must send an episode to the same backend.

use std::sync::atomic::{AtomicU64, Ordering};

/// Points per backend on the ring: enough that episodes spread within a few percent across a handful of
/// backends.
const POINTS_PER_BACKEND: u32 = 160;

/// One backend as routing sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Requests in flight or queued on it.
    pub outstanding: u32,
    /// Whether it may take this request (routable and not excluded).
    pub eligible: bool,
}

/// The routable backend with the fewest requests in flight; ties go to a random one of them.
pub fn least_outstanding(candidates: &[Candidate], random: u64) -> Option<usize> {
    let min = candidates.iter().filter(|c| c.eligible).map(|c| c.outstanding).min()?;
    let tied: Vec<usize> =
        (0..candidates.len()).filter(|&i| candidates[i].eligible && candidates[i].outstanding == min).collect();
    Some(tied[(random % tied.len() as u64) as usize])
}

/// Two distinct routable backends at random, the one with fewer requests in flight.
pub fn power_of_two(candidates: &[Candidate], random: u64) -> Option<usize> {
    let eligible: Vec<usize> = (0..candidates.len()).filter(|&i| candidates[i].eligible).collect();
    match eligible.len() {
        0 => None,
        1 => Some(eligible[0]),
        n => {
            let first = (random % n as u64) as usize;
            let offset = 1 + ((random >> 32) % (n as u64 - 1)) as usize;
            let (a, b) = (eligible[first], eligible[(first + offset) % n]);
            Some(if candidates[b].outstanding < candidates[a].outstanding { b } else { a })
        }
    }
}

/// A consistent-hash ring over a pool's backends.
#[derive(Debug, Clone)]
pub struct Ring {
    points: Vec<(u64, usize)>,
    backends: usize,
}

impl Ring {
    /// A ring over backends named `labels` (their URLs): a backend keeps its points whatever the others are.
    pub fn new(labels: &[String]) -> Self {
        let mut points = Vec::with_capacity(labels.len() * POINTS_PER_BACKEND as usize);
        for (index, label) in labels.iter().enumerate() {
            for point in 0..POINTS_PER_BACKEND {
                points.push((hash(format!("{label}#{point}").as_bytes()), index));
            }
        }
        points.sort_unstable();
        Self { points, backends: labels.len() }
    }

    /// The backends in the order `key` meets them on the ring, each once: its home first.
    pub fn walk(&self, key: &str) -> impl Iterator<Item = usize> + '_ {
        let start = self.points.partition_point(|&(point, _)| point < hash(key.as_bytes()));
        let mut seen = vec![false; self.backends];
        let mut left = self.backends;
        self.points.iter().cycle().skip(start).take(self.points.len()).filter_map(move |&(_, index)| {
            if left == 0 || seen[index] {
                return None;
            }
            seen[index] = true;
            left -= 1;
            Some(index)
        })
    }
}

/// The episode's backend: the first eligible one on its ring walk whose load stays under the bound
/// `max(min_load, ceil(factor * (total + 1) / eligible))`; when every eligible backend is over it, the least
/// loaded. Also says whether that is the episode's home (the first backend on the walk, eligible or not).
pub fn affinity(ring: &Ring, key: &str, candidates: &[Candidate], factor: f64, min_load: u32) -> Option<(usize, bool)> {
    let eligible = candidates.iter().filter(|c| c.eligible).count();
    if eligible == 0 {
        return None;
    }
    let total: u64 = candidates.iter().filter(|c| c.eligible).map(|c| u64::from(c.outstanding)).sum();
    let bound = ((factor * (total + 1) as f64 / eligible as f64).ceil() as u64).max(u64::from(min_load));
    let mut walk = ring.walk(key).peekable();
    let home = *walk.peek()?;
    for index in walk {
        let candidate = candidates[index];
        if candidate.eligible && u64::from(candidate.outstanding) < bound {
            return Some((index, index == home));
        }
    }
    least_outstanding(candidates, 0).map(|index| (index, index == home))
}

/// FNV-1a over `bytes`, then a SplitMix64 finaliser so that near-identical keys land far apart.
fn hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A fast, non-cryptographic random number for load-balancing choices and jitter (SplitMix64 over a shared
/// counter seeded from the clock).
pub fn random() -> u64 {
    static STATE: std::sync::LazyLock<AtomicU64> = std::sync::LazyLock::new(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        AtomicU64::new(now.map_or(1, |d| d.as_nanos() as u64))
    });
    mix(STATE.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed))
}

/// Uniform in [0, 1).
pub fn random_unit() -> f64 {
    (random() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(n: usize) -> Vec<Candidate> {
        vec![Candidate { outstanding: 0, eligible: true }; n]
    }

    fn labels(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("http://10.0.0.{i}:8000/v1")).collect()
    }

    #[test]
    fn least_outstanding_skips_ineligible_and_busy() {
        let c = [
            Candidate { outstanding: 0, eligible: false },
            Candidate { outstanding: 3, eligible: true },
            Candidate { outstanding: 1, eligible: true },
        ];
        assert_eq!(least_outstanding(&c, 12345), Some(2));
        assert_eq!(least_outstanding(&[Candidate { outstanding: 0, eligible: false }], 0), None);
    }

    #[test]
    fn power_of_two_never_picks_the_busier_of_two_or_an_ineligible_one() {
        let c = [Candidate { outstanding: 5, eligible: true }, Candidate { outstanding: 1, eligible: true }];
        for r in 0..64 {
            assert_eq!(power_of_two(&c, random().wrapping_add(r)), Some(1));
        }
        let one = [Candidate { outstanding: 0, eligible: false }, Candidate { outstanding: 9, eligible: true }];
        assert_eq!(power_of_two(&one, 7), Some(1));
    }

    #[test]
    fn an_episode_stays_home_and_moves_only_when_home_is_gone() {
        let ring = Ring::new(&labels(4));
        let mut candidates = idle(4);
        let (home, hit) = affinity(&ring, "episode-7", &candidates, 1.25, 16).expect("routable");
        assert!(hit);
        for _ in 0..10 {
            assert_eq!(affinity(&ring, "episode-7", &candidates, 1.25, 16), Some((home, true)));
        }
        candidates[home].eligible = false;
        let (moved, hit) = affinity(&ring, "episode-7", &candidates, 1.25, 16).expect("others routable");
        assert!(moved != home && !hit);
    }

    #[test]
    fn bounded_load_spills_an_overloaded_home() {
        let ring = Ring::new(&labels(3));
        let mut candidates = idle(3);
        let (home, _) = affinity(&ring, "e", &candidates, 1.25, 2).expect("routable");
        candidates[home].outstanding = 10;
        let (chosen, hit) = affinity(&ring, "e", &candidates, 1.25, 2).expect("routable");
        assert!(chosen != home && !hit, "home holds 10 of 10 in flight, over the bound");
    }

    #[test]
    fn removing_a_backend_moves_only_its_episodes() {
        let four = Ring::new(&labels(4));
        let three = Ring::new(&labels(3));
        let keys: Vec<String> = (0..2000).map(|i| format!("episode-{i}")).collect();
        let moved = keys
            .iter()
            .filter(|k| {
                let before = four.walk(k).next().expect("home");
                before != 3 && three.walk(k).next() != Some(before)
            })
            .count();
        assert_eq!(moved, 0, "episodes of the remaining backends keep their home");
        let on_each = (0..4).map(|b| keys.iter().filter(|k| four.walk(k).next() == Some(b)).count());
        for count in on_each {
            assert!((300..=700).contains(&count), "episodes spread across backends: {count} of 2000");
        }
    }
}
