//! `kforge-device-probe`: is this GPU healthy? The engine's device lanes run it (`devices/health.rs`) in a
//! short-lived process after a CUDA-level fault (and again while a device is quarantined): it creates a context on
//! the device, runs a tiny kernel (`out[i] = 3 i + 7` over a million elements, loaded from PTX so no compiler is
//! needed), copies the result back and checks every element.
//!
//! Prints one JSON object on stdout and exits 0 when the device passed, 1 when it failed, 2 when there is no CUDA
//! driver to probe. The device is `--ordinal N` (default 0) among those `CUDA_VISIBLE_DEVICES` leaves visible.
//! The caller owns the timeout: a wedged device can hang any driver call.

// Launching a kernel is an FFI call whose argument types the compiler cannot check; it is the only unsafe code.
#![allow(unsafe_code)]

use std::process::ExitCode;
use std::time::Instant;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

/// `kforge_probe(u32* out, u32 n)`: `out[i] = 3 * i + 7` for `i < n`. PTX ISA 7.0 for sm_50 and later; the driver
/// JIT-compiles it for the device at hand.
const PROBE_PTX: &str = r#"
.version 7.0
.target sm_50
.address_size 64

.visible .entry kforge_probe(
    .param .u64 out,
    .param .u32 n
)
{
    .reg .pred %p;
    .reg .b32 %r<7>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p, %r5, %r1;
    @%p bra DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r5, 4;
    add.s64 %rd4, %rd2, %rd3;
    mad.lo.s32 %r6, %r5, 3, 7;
    st.global.u32 [%rd4], %r6;
DONE:
    ret;
}
"#;

const ELEMENTS: u32 = 1 << 20;

/// What the probe saw on a healthy device.
#[derive(Debug)]
struct Healthy {
    device: String,
    free_bytes: usize,
    total_bytes: usize,
}

fn probe(ordinal: usize) -> Result<Healthy, String> {
    let step = |what: &'static str| move |e: cudarc::driver::DriverError| format!("{what}: {e}");
    let context = CudaContext::new(ordinal).map_err(step("creating a context"))?;
    let device = context.name().map_err(step("device name"))?;
    let (free_bytes, total_bytes) = context.mem_get_info().map_err(step("memory info"))?;
    let module = context.load_module(Ptx::from_src(PROBE_PTX)).map_err(step("loading the probe kernel"))?;
    let function = module.load_function("kforge_probe").map_err(step("finding the probe kernel"))?;
    let stream = context.default_stream();
    let mut out = stream.alloc_zeros::<u32>(ELEMENTS as usize).map_err(step("allocating"))?;
    let mut launch = stream.launch_builder(&function);
    launch.arg(&mut out).arg(&ELEMENTS);
    // SAFETY: the kernel takes (u32*, u32) and writes only `out[0..n)`, which `out` holds.
    unsafe { launch.launch(LaunchConfig::for_num_elems(ELEMENTS)) }.map_err(step("launching"))?;
    let host = stream.clone_dtoh(&out).map_err(step("copying the result back"))?;
    if let Some((index, value)) = host.iter().enumerate().find(|&(i, &v)| v != 3 * i as u32 + 7) {
        return Err(format!("wrong result at element {index}: {value}, expected {}", 3 * index + 7));
    }
    Ok(Healthy { device, free_bytes, total_bytes })
}

fn main() -> ExitCode {
    let ordinal = match std::env::args().skip_while(|a| a != "--ordinal").nth(1).map(|n| n.parse::<usize>()) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(e)) => {
            eprintln!("--ordinal: {e}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    // SAFETY: only tries to open the driver library; cudarc would panic on first use without it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        let report = serde_json::json!({ "ok": false, "error": "no CUDA driver library (libcuda) on this host" });
        println!("{report}");
        return ExitCode::from(2);
    }
    let (report, code) = match probe(ordinal) {
        Ok(Healthy { device, free_bytes, total_bytes }) => (
            serde_json::json!({
                "ok": true,
                "ordinal": ordinal,
                "device": device,
                "free_bytes": free_bytes,
                "total_bytes": total_bytes,
                "ms": started.elapsed().as_secs_f64() * 1e3,
            }),
            ExitCode::SUCCESS,
        ),
        Err(error) => (serde_json::json!({ "ok": false, "ordinal": ordinal, "error": error }), ExitCode::FAILURE),
    };
    println!("{report}");
    code
}
