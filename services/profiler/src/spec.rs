//! A device's specification from its CUDA attributes (`CUdevice_attribute` numbers and values, as the driver gives
//! them), with peak memory bandwidth from the bus width and memory clock, and peak dense throughputs from a table
//! of operations per SM per clock by architecture.

use std::collections::BTreeMap;

use kforge_proto::v1 as pb;

/// `CUdevice_attribute` numbers (cuda.h).
mod attribute {
    pub const MAX_THREADS_PER_BLOCK: u32 = 1;
    pub const WARP_SIZE: u32 = 10;
    pub const MAX_REGISTERS_PER_BLOCK: u32 = 12;
    pub const CLOCK_RATE_KHZ: u32 = 13;
    pub const MULTIPROCESSOR_COUNT: u32 = 16;
    pub const MEMORY_CLOCK_RATE_KHZ: u32 = 36;
    pub const GLOBAL_MEMORY_BUS_WIDTH: u32 = 37;
    pub const L2_CACHE_SIZE: u32 = 38;
    pub const MAX_THREADS_PER_MULTIPROCESSOR: u32 = 39;
    pub const COMPUTE_CAPABILITY_MAJOR: u32 = 75;
    pub const COMPUTE_CAPABILITY_MINOR: u32 = 76;
    pub const MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: u32 = 81;
    pub const MAX_REGISTERS_PER_MULTIPROCESSOR: u32 = 82;
    pub const MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: u32 = 97;
    pub const MAX_BLOCKS_PER_MULTIPROCESSOR: u32 = 106;
}

/// Every attribute [`spec`] reads.
pub const ATTRIBUTES: &[u32] = &[
    attribute::MAX_THREADS_PER_BLOCK,
    attribute::WARP_SIZE,
    attribute::MAX_REGISTERS_PER_BLOCK,
    attribute::CLOCK_RATE_KHZ,
    attribute::MULTIPROCESSOR_COUNT,
    attribute::MEMORY_CLOCK_RATE_KHZ,
    attribute::GLOBAL_MEMORY_BUS_WIDTH,
    attribute::L2_CACHE_SIZE,
    attribute::MAX_THREADS_PER_MULTIPROCESSOR,
    attribute::COMPUTE_CAPABILITY_MAJOR,
    attribute::COMPUTE_CAPABILITY_MINOR,
    attribute::MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
    attribute::MAX_REGISTERS_PER_MULTIPROCESSOR,
    attribute::MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    attribute::MAX_BLOCKS_PER_MULTIPROCESSOR,
];

/// Dense operations per SM per clock by compute capability, and the precision each counts. Derived from NVIDIA's
/// published peaks (datasheets and architecture whitepapers for A100, A10, L40, H100 SXM, B200) divided by SM count
/// and the clock the datasheet quotes; FP32 counts a fused multiply-add as two operations. Tensor figures are
/// dense (no structured sparsity). Architectures not listed get no peaks.
/// A compute capability and, per precision, its dense operations per SM per clock.
type Peaks = ((u32, u32), &'static [(&'static str, u32)]);

const OPS_PER_SM_PER_CLOCK: &[Peaks] = &[
    (
        (8, 0),
        &[("fp32", 128), ("tf32_tensor", 1024), ("bf16_tensor", 2048), ("fp16_tensor", 2048), ("int8_tensor", 4096)],
    ),
    (
        (8, 6),
        &[("fp32", 256), ("tf32_tensor", 512), ("bf16_tensor", 1024), ("fp16_tensor", 1024), ("int8_tensor", 2048)],
    ),
    (
        (8, 9),
        &[
            ("fp32", 256),
            ("tf32_tensor", 256),
            ("bf16_tensor", 512),
            ("fp16_tensor", 512),
            ("fp8_tensor", 1024),
            ("int8_tensor", 1024),
        ],
    ),
    (
        (9, 0),
        &[
            ("fp32", 256),
            ("tf32_tensor", 2048),
            ("bf16_tensor", 4096),
            ("fp16_tensor", 4096),
            ("fp8_tensor", 8192),
            ("int8_tensor", 8192),
        ],
    ),
    (
        (10, 0),
        &[
            ("fp32", 256),
            ("tf32_tensor", 4096),
            ("bf16_tensor", 8192),
            ("fp16_tensor", 8192),
            ("fp8_tensor", 16384),
            ("int8_tensor", 16384),
        ],
    ),
];

/// Peak memory bandwidth in GB/s: two transfers per memory clock (double data rate) over the bus.
pub fn peak_bandwidth_gbps(memory_clock_khz: u64, bus_width_bits: u64) -> f64 {
    2.0 * memory_clock_khz as f64 * 1e3 * (bus_width_bits as f64 / 8.0) / 1e9
}

/// Peak dense throughputs in TFLOP/s (TOP/s for int8) of `sms` SMs of compute capability `capability` at
/// `clock_khz`.
pub fn peak_tflops(capability: (u32, u32), sms: u32, clock_khz: u64) -> BTreeMap<String, f64> {
    let Some((_, ops)) = OPS_PER_SM_PER_CLOCK.iter().find(|(cc, _)| *cc == capability) else {
        return BTreeMap::new();
    };
    ops.iter()
        .map(|(precision, per_clock)| {
            ((*precision).to_owned(), *per_clock as f64 * sms as f64 * clock_khz as f64 * 1e3 / 1e12)
        })
        .collect()
}

/// The specification of a device named `name` with `total_memory_bytes` and these attributes (missing ones read
/// as 0).
pub fn spec(name: &str, total_memory_bytes: u64, attributes: &BTreeMap<u32, i64>) -> pb::DeviceSpec {
    let get = |number: u32| attributes.get(&number).copied().unwrap_or(0).max(0) as u64;
    let capability = (get(attribute::COMPUTE_CAPABILITY_MAJOR) as u32, get(attribute::COMPUTE_CAPABILITY_MINOR) as u32);
    let sms = get(attribute::MULTIPROCESSOR_COUNT) as u32;
    let clock_khz = get(attribute::CLOCK_RATE_KHZ);
    let memory_clock_khz = get(attribute::MEMORY_CLOCK_RATE_KHZ);
    let bus_width = get(attribute::GLOBAL_MEMORY_BUS_WIDTH);
    pb::DeviceSpec {
        name: name.to_owned(),
        compute_capability: format!("{}.{}", capability.0, capability.1),
        sm_count: sms,
        shared_memory_per_block_bytes: get(attribute::MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        shared_memory_per_sm_bytes: get(attribute::MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        registers_per_sm: get(attribute::MAX_REGISTERS_PER_MULTIPROCESSOR) as u32,
        l2_cache_bytes: get(attribute::L2_CACHE_SIZE),
        memory_bus_width_bits: bus_width as u32,
        memory_clock_khz,
        peak_memory_bandwidth_gbps: peak_bandwidth_gbps(memory_clock_khz, bus_width),
        peak_tflops: peak_tflops(capability, sms, clock_khz).into_iter().collect(),
        total_memory_bytes,
        sm_clock_khz: clock_khz,
        max_threads_per_block: get(attribute::MAX_THREADS_PER_BLOCK) as u32,
        max_threads_per_sm: get(attribute::MAX_THREADS_PER_MULTIPROCESSOR) as u32,
        max_blocks_per_sm: get(attribute::MAX_BLOCKS_PER_MULTIPROCESSOR) as u32,
        warp_size: get(attribute::WARP_SIZE) as u32,
        max_registers_per_block: get(attribute::MAX_REGISTERS_PER_BLOCK) as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recorded_h100_reads_as_its_datasheet_says() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/h100/device_attributes.json");
        let recorded: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json");
        let attributes: BTreeMap<u32, i64> = recorded["attributes"]
            .as_object()
            .expect("attributes")
            .iter()
            .map(|(number, value)| (number.parse().expect("number"), value.as_i64().expect("integer")))
            .collect();
        let name = recorded["name"].as_str().expect("name");
        let spec = spec(name, recorded["total_memory_bytes"].as_u64().expect("bytes"), &attributes);
        assert_eq!(spec.name, "NVIDIA H100 80GB HBM3");
        assert_eq!((spec.compute_capability.as_str(), spec.sm_count, spec.warp_size), ("9.0", 132, 32));
        assert_eq!((spec.max_threads_per_block, spec.max_threads_per_sm, spec.max_blocks_per_sm), (1024, 2048, 32));
        assert_eq!((spec.registers_per_sm, spec.shared_memory_per_block_bytes), (65536, 232448));
        assert_eq!(spec.l2_cache_bytes, 50 << 20);
        // H100 SXM: 3.35 TB/s; FP32 67 TFLOP/s at the 1980 MHz maximum clock.
        assert!((spec.peak_memory_bandwidth_gbps - 3352.3).abs() < 1.0, "{}", spec.peak_memory_bandwidth_gbps);
        assert!((spec.peak_tflops["fp32"] - 66.9).abs() < 0.1, "{:?}", spec.peak_tflops);
        assert!(spec.peak_tflops["bf16_tensor"] > 1000.0 && spec.peak_tflops.contains_key("fp8_tensor"));
        assert!(peak_tflops((7, 5), 40, 1_500_000).is_empty(), "no table entry: no peaks");
    }
}
