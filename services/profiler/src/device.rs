//! Reading a device's specification through the CUDA driver (cudarc, loaded at run time: a host without a driver
//! says so instead of failing to start).

use std::collections::BTreeMap;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::CUdevice_attribute as A;
use kforge_proto::v1 as pb;

use crate::spec;

/// Why a device could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("no CUDA driver library (libcuda) on this host")]
    NoDriver,
    #[error("device {ordinal}: {error}")]
    Driver { ordinal: u32, error: String },
}

/// The attributes [`spec::spec`] reads, by number and as cudarc names them.
const ATTRIBUTES: &[(u32, A)] = &[
    (1, A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
    (10, A::CU_DEVICE_ATTRIBUTE_WARP_SIZE),
    (12, A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK),
    (13, A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE),
    (16, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
    (36, A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
    (37, A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
    (38, A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
    (39, A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR),
    (75, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
    (76, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
    (81, A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
    (82, A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR),
    (97, A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
    (106, A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR),
];

/// Whether the driver library can be loaded (cudarc panics on first use where it cannot).
#[allow(unsafe_code)]
fn driver_present() -> bool {
    // SAFETY: only tries to open the driver library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Device `ordinal`'s specification, read from the driver (blocking: call it off the async runtime).
pub fn read(ordinal: u32) -> Result<pb::DeviceSpec, DeviceError> {
    if !driver_present() {
        return Err(DeviceError::NoDriver);
    }
    let driver = |error: cudarc::driver::DriverError| DeviceError::Driver { ordinal, error: error.to_string() };
    let context = CudaContext::new(ordinal as usize).map_err(driver)?;
    let name = context.name().map_err(driver)?;
    let total = context.total_mem().map_err(driver)? as u64;
    let mut attributes = BTreeMap::new();
    for (number, attribute) in ATTRIBUTES {
        attributes.insert(*number, i64::from(context.attribute(*attribute).map_err(driver)?));
    }
    Ok(spec::spec(&name, total, &attributes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_attribute_the_spec_reads_is_read_from_the_driver() {
        let read: Vec<u32> = ATTRIBUTES
            .iter()
            .map(|(number, attribute)| {
                assert_eq!(*number, *attribute as u32, "{attribute:?}");
                *number
            })
            .collect();
        assert_eq!(read, spec::ATTRIBUTES);
    }
}
