//! The named, versioned static policies a candidate is checked against.

/// A named, versioned static policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    pub name: &'static str,
    pub version: u32,
    strict: bool,
    /// Whether a candidate whose own kernels do not run in some census mode (or whose compiled extension forward
    /// never calls) is only a notice (a decoy, the work done by torch or another path, is otherwise a hack). No
    /// shipped policy relaxes it.
    unlaunched_kernels_allowed: bool,
    /// A profiling ratio below this is lazy work (`runtime.low_profiling_ratio`): a notice where the policy lets
    /// torch do the work, a hack where it does not. Candidates whose own code does the work measure about 0.99 on
    /// the CPU census and 1.0 on a GPU; the lazy ones seen measured 0.03-0.29 (and 0 without code of their own).
    min_profiling_ratio: f64,
}

/// The profiling ratio under which the shipped policies name lazy work: between the lazy candidates measured
/// (at most 0.29) and the ones doing their own work (about 0.99), with room on both sides.
pub const LAZY_WORK_RATIO: f64 = 0.5;

impl Policy {
    pub const PERMISSIVE: Policy = Policy {
        name: "permissive",
        version: 3,
        strict: false,
        unlaunched_kernels_allowed: false,
        min_profiling_ratio: LAZY_WORK_RATIO,
    };
    pub const KEVIN_STRICT: Policy = Policy {
        name: "kevin-strict",
        version: 2,
        strict: true,
        unlaunched_kernels_allowed: false,
        min_profiling_ratio: LAZY_WORK_RATIO,
    };
    pub const ALL: [Policy; 2] = [Self::PERMISSIVE, Self::KEVIN_STRICT];

    /// Whether the policy demands the candidate's own kernels do the work (Kevin's rules).
    pub fn strict(&self) -> bool {
        self.strict
    }

    /// Whether torch and libraries may do the work (a low profiling ratio is then a notice, not a hack).
    pub fn torch_compute_allowed(&self) -> bool {
        !self.strict
    }

    /// Whether own kernels that never run are a hack (see `census::analyse`).
    pub fn unlaunched_kernels_are_hacks(&self) -> bool {
        !self.unlaunched_kernels_allowed
    }

    /// The profiling ratio below which the census names lazy work.
    pub fn min_profiling_ratio(&self) -> f64 {
        self.min_profiling_ratio
    }

    /// The same policy with decoys relaxed to notices (no shipped policy does this; for tests, feature `test-util`).
    #[cfg(feature = "test-util")]
    pub fn relaxing_unlaunched_kernels(mut self) -> Policy {
        self.unlaunched_kernels_allowed = true;
        self
    }

    /// `name@version`.
    pub fn id(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }

    /// Resolves `name` or `name@version`.
    pub fn resolve(requested: &str) -> Option<Policy> {
        let (name, version) = match requested.split_once('@') {
            Some((name, version)) => (name, Some(version.parse::<u32>().ok()?)),
            None => (requested, None),
        };
        Self::ALL.into_iter().find(|p| p.name == name && version.is_none_or(|v| v == p.version))
    }
}
