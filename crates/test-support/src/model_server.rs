//! A real model server for tests: llama.cpp's OpenAI-compatible server (`python -m llama_cpp.server`, from
//! llama-cpp-python) serving SmolLM2-135M-Instruct on the CPU, both installed into the repository's `.venv` by
//! `scripts/setup_model.sh`.
//!
//! [`ModelSetup::find`] locates the installation, or says `SKIP:` and what is missing (a failure under
//! `KFORGE_CI=1`, where set-up has installed it). [`ModelSetup::start`] starts a server on a [`ReservedPort`] of
//! its own (uvicorn binds it with SO_REUSEADDR beside the reservation) and hands it out once its log says it
//! listens and `GET /v1/models` answers: readiness read from the server, never a sleep. The server is killed when
//! its [`ModelServer`] is dropped, and exits by itself when the test process dies without dropping it (a panic
//! that aborts, a server in a `static`, a SIGKILL): it watches its stdin, a pipe the test holds, and leaves at end
//! of file. [`ModelServer::kill`] and [`ModelServer::restart`] let a test take it away from a client and bring it
//! back on the same port, which the reservation keeps while the server is down (connections are refused then).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::ReservedPort;

/// How long a server may take from its start to listening: loading a 98 MB model takes about a second; a machine
/// busy building leaves it much slower.
const START_TIMEOUT: Duration = Duration::from_secs(180);
/// Log lines kept for an error message.
const TAIL_LINES: usize = 40;
/// `python -m llama_cpp.server ARGS`, with a thread that ends the process when stdin reaches end of file.
const LAUNCHER: &str = "import os, runpy, sys, threading
def watch():
    sys.stdin.buffer.read()
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
sys.argv = ['llama_cpp.server', *sys.argv[1:]]
runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)
";

/// An installed server and model: the venv's interpreter and the GGUF file.
#[derive(Debug, Clone)]
pub struct ModelSetup {
    pub python: PathBuf,
    pub model: PathBuf,
}

/// How a server is started.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The name the server answers to in `/v1/models` (`--model_alias`).
    pub alias: String,
    /// Context length in tokens: the prompt and the completion together.
    pub n_ctx: u32,
    /// Keep the logits of every position, which log-probabilities need (llama-cpp-python refuses `logprobs`
    /// without it). It costs an `n_ctx` x vocabulary array of floats (49,152 tokens: 192 KiB per position).
    pub logits_all: bool,
    /// CPU threads for generation and for prompt processing.
    pub threads: u32,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self { alias: "smollm2".into(), n_ctx: 2048, logits_all: true, threads: 2 }
    }
}

impl ModelSetup {
    /// The installation under the repository at `root`, or `None` once the test's output says `SKIP:` and what is
    /// missing. Under `KFORGE_CI=1` a missing installation fails the test instead.
    pub fn find(root: &Path) -> Option<Self> {
        match Self::locate(root) {
            Ok(setup) => Some(setup),
            Err(missing) => {
                crate::python::skip(format!("{missing}: run scripts/setup_model.sh"));
                None
            }
        }
    }

    fn locate(root: &Path) -> Result<Self, String> {
        let python = root.join(".venv/bin/python");
        if !python.exists() {
            return Err(format!("{} is missing", python.display()));
        }
        let script = root.join("scripts/setup_model.sh");
        let output = Command::new(&script)
            .arg("--print-model")
            .output()
            .map_err(|e| format!("{} does not run: {e}", script.display()))?;
        let model = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
        if !output.status.success() || !model.is_file() {
            return Err("the model (.venv/models/SmolLM2-135M-Instruct.Q4_1.gguf) is not installed".into());
        }
        let import = Command::new(&python)
            .args(["-c", "import llama_cpp.server.app"])
            .output()
            .map_err(|e| format!("{} does not run: {e}", python.display()))?;
        if !import.status.success() {
            let stderr = String::from_utf8_lossy(&import.stderr);
            let last = stderr.lines().last().unwrap_or("").to_owned();
            return Err(format!("llama-cpp-python[server] is not installed in .venv ({last})"));
        }
        Ok(Self { python, model })
    }

    /// Starts a server with `options` on a reserved loopback port and waits until it serves.
    pub fn start(&self, options: ServerOptions) -> ModelServer {
        static SERVERS: AtomicU32 = AtomicU32::new(0);
        let instance = SERVERS.fetch_add(1, Ordering::Relaxed);
        let log_dir = std::env::temp_dir().join(format!("kforge-model-server-{}-{instance}", std::process::id()));
        std::fs::create_dir_all(&log_dir).expect("log directory");
        let mut server = ModelServer {
            setup: self.clone(),
            options,
            port: ReservedPort::new(),
            child: None,
            log_dir,
            starts: 0,
            tail: Arc::default(),
        };
        server.spawn();
        server
    }
}

/// A running llama.cpp server; killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct ModelServer {
    setup: ModelSetup,
    options: ServerOptions,
    /// Held for the server's whole life, restarts included.
    port: ReservedPort,
    /// The server and the write end of its stdin: dropping either ends it.
    child: Option<(Child, ChildStdin)>,
    log_dir: PathBuf,
    /// Servers started so far (a restart is one more): each writes a log of its own.
    starts: u32,
    tail: Arc<Mutex<Vec<String>>>,
}

impl ModelServer {
    /// The OpenAI base URL, `http://127.0.0.1:PORT/v1`.
    pub fn url(&self) -> String {
        format!("{}/v1", self.port.url())
    }

    /// The name the server answers to.
    pub fn alias(&self) -> &str {
        &self.options.alias
    }

    /// The log of the latest start (stderr: llama.cpp's and uvicorn's lines, one per request).
    pub fn log_path(&self) -> PathBuf {
        self.log_dir.join(format!("server-{}.log", self.starts))
    }

    /// The last lines the server logged, for a failure message.
    pub fn log_tail(&self) -> String {
        self.tail.lock().map(|tail| tail.join("\n")).unwrap_or_default()
    }

    /// Kills the server at once (SIGKILL: no response is finished, connections are reset) and reaps it.
    pub fn kill(&mut self) {
        if let Some((mut child, stdin)) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            drop(stdin);
        }
    }

    /// Starts the server again on the same port (after [`kill`](Self::kill)) and waits until it serves.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Starts the server on the reserved port and waits for it; panics with the log's tail if it exits or does
    /// not listen within [`START_TIMEOUT`].
    fn spawn(&mut self) {
        self.starts += 1;
        let port = self.port.port();
        let o = &self.options;
        let log_path = self.log_path();
        let stdout = std::fs::File::create(log_path.with_extension("stdout")).expect("stdout log");
        let mut child = Command::new(&self.setup.python)
            .args(["-c", LAUNCHER, "--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("--model")
            .arg(&self.setup.model)
            .args(["--model_alias", &o.alias, "--n_ctx", &o.n_ctx.to_string()])
            .args(["--n_threads", &o.threads.to_string(), "--n_threads_batch", &o.threads.to_string()])
            .args(["--logits_all", if o.logits_all { "true" } else { "false" }])
            // By default a new request ends the one streaming (`[DONE]` mid-answer): requests queue instead.
            .args(["--interrupt_requests", "false", "--verbose", "false"])
            .env("PYTHONUNBUFFERED", "1")
            // llama.cpp's threads wait for each other asleep instead of spinning: beside another busy multi-threaded
            // process (a PyTorch trainer) spinning made a 64-token request take 95-100 s instead of 4 s on 2 cores.
            .env("OMP_WAIT_POLICY", "PASSIVE")
            .stdin(Stdio::piped())
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{} (llama_cpp.server) does not start: {e}", self.setup.python.display()));
        let stderr = child.stderr.take().expect("piped stderr");
        let stdin = child.stdin.take().expect("piped stdin");
        let (listening, heard) = mpsc::channel::<u16>();
        self.tail = Arc::default();
        let tail = self.tail.clone();
        let mut log = std::fs::File::create(&log_path).expect("server log");
        // Drains stderr for the server's whole life (a full pipe would stall it), keeping a tail and reporting the
        // port of uvicorn's `Uvicorn running on http://127.0.0.1:PORT` line, once it listens. The sender drops at end of file, so
        // a server that dies before listening ends the wait at once.
        std::thread::spawn(move || {
            let mut listening = Some(listening);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let _ = writeln!(log, "{line}");
                if let Some(port) = listening_port(&line)
                    && let Some(sender) = listening.take()
                {
                    let _ = sender.send(port);
                }
                if let Ok(mut tail) = tail.lock() {
                    if tail.len() == TAIL_LINES {
                        tail.remove(0);
                    }
                    tail.push(line);
                }
            }
        });
        self.child = Some((child, stdin));
        let started = Instant::now();
        match heard.recv_timeout(START_TIMEOUT) {
            Ok(listening) => assert_eq!(listening, port, "the server listens on its reserved port"),
            Err(error) => {
                let status = self.child.as_mut().and_then(|(c, _)| c.try_wait().ok().flatten());
                self.kill();
                panic!(
                    "llama.cpp server did not listen ({error}; exit status {status:?}) after {:?}; {}:\n{}",
                    started.elapsed(),
                    log_path.display(),
                    self.log_tail()
                );
            }
        }
        // The model loads before uvicorn binds, so the first request is served; check that it is.
        let models = http_get(port, "/v1/models")
            .unwrap_or_else(|e| panic!("GET /v1/models of a listening server: {e}\n{}", self.log_tail()));
        assert!(models.contains(&self.options.alias), "/v1/models does not list {}: {models}", self.options.alias);
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The port of uvicorn's start-up line, `Uvicorn running on http://127.0.0.1:PORT (Press CTRL+C to quit)`.
fn listening_port(line: &str) -> Option<u16> {
    let rest = line.split("Uvicorn running on http://").nth(1)?;
    let address = rest.split_whitespace().next()?;
    address.rsplit(':').next()?.parse().ok()
}

/// `GET path` on the loopback port: the body of a 200, else the status line.
pub fn http_get(port: u16, path: &str) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut response = String::new();
    stream.read_to_string(&mut response).map_err(|e| format!("read: {e}"))?;
    let (head, body) = response.split_once("\r\n\r\n").ok_or("no header end")?;
    let status = head.lines().next().unwrap_or_default();
    if !status.contains(" 200 ") {
        return Err(status.to_owned());
    }
    Ok(body.to_owned())
}

#[cfg(test)]
mod tests {
    use super::{ModelSetup, listening_port};

    #[test]
    fn a_checkout_without_the_venv_is_named_as_missing() {
        let missing = ModelSetup::locate(std::path::Path::new("/nonexistent-kforge-root")).expect_err("no venv");
        assert_eq!(missing, "/nonexistent-kforge-root/.venv/bin/python is missing");
    }

    #[test]
    fn the_port_is_read_from_uvicorns_start_line() {
        let line = "INFO:     Uvicorn running on http://127.0.0.1:41235 (Press CTRL+C to quit)";
        assert_eq!(listening_port(line), Some(41235));
        assert_eq!(listening_port("INFO:     Started server process [12]"), None);
    }
}
