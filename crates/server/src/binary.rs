//! The `main` of every single-service binary (`kforge-reward`, ...): one page, the same everywhere.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitCode;

use tokio::net::TcpListener;

use crate::{ServeError, ServiceConfig, load_section, run_service};

/// Parses `[--config FILE]`, loads the service's table, starts telemetry, serves until SIGTERM/SIGINT and drains.
/// Errors are one line on stderr and exit code 1; a usage error exits 2.
pub fn main<C, F, Fut>(serve: F) -> ExitCode
where
    C: ServiceConfig,
    F: FnOnce(C, TcpListener, Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
    Fut: Future<Output = Result<(), ServeError>>,
{
    let program = format!("kforge-{}", C::SECTION);
    let config_path = match parse_args(&program, std::env::args().skip(1)) {
        Ok(Some(path)) => path,
        Ok(None) => return ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{program}: {message}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("{program}: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result: Result<(), String> = runtime.block_on(async {
        let config: C = load_section(config_path.as_deref()).map_err(|e| e.to_string())?;
        let _telemetry = kforge_telemetry::init(&program, "info").map_err(|e| e.to_string())?;
        run_service(config, serve).await.map_err(|e| e.to_string())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{program}: {message}");
            ExitCode::FAILURE
        }
    }
}

/// `Ok(None)` after printing help.
fn parse_args(program: &str, mut args: impl Iterator<Item = String>) -> Result<Option<Option<PathBuf>>, String> {
    let mut config = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--config" => config = Some(PathBuf::from(args.next().ok_or("--config needs a file")?)),
            "-h" | "--help" => {
                println!(
                    "usage: {program} [--config FILE]\n\nRuns one kforge service (the same as `kforge serve`). \
                     Settings come from FILE's table for this service and KFORGE__<SECTION>__<KEY> variables."
                );
                return Ok(None);
            }
            other => return Err(format!("unexpected argument `{other}` (try --help)")),
        }
    }
    Ok(Some(config))
}
