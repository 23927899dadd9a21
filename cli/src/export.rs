//! `kforge export JOB --out FILE`: a job's training samples (Orchestrator/ExportSamples) as JSONL, one proto3 JSON
//! object (`kforge.v1.Sample`) per line, or as Parquet, one row per sample in the columns `export/parquet.rs`'s
//! `SCHEMA` lists. Without `--addr`, an orchestrator runs in this process on the store `kforge run` would use
//! (`--work-dir DIR`'s, else the configured one, else the default), resuming nothing; a job it does not hold is
//! NOT_FOUND naming that store.

mod parquet;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_server::client::{self, ClientConfig};
use kforge_server::config::AuthConfig;
use tokio_stream::StreamExt as _;

use crate::call::CallError;
use crate::mesh::{Mesh, MeshConfig, Service};
use crate::store::{redact_url, sqlite_file, store_for_run};

/// What `kforge export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One proto3 JSON object per line.
    Jsonl,
    /// One row per sample, in columns a trainer reads as they are (`prompt` as chat messages, token ids as lists).
    Parquet,
}

/// `kforge export`'s arguments.
#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// The job.
    job_id: String,
    /// The file to write (`-` for stdout, JSONL only).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// The file's format [default: parquet when FILE ends in .parquet, else jsonl].
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// Start after the sample with this cursor (each sample's `cursor`). JSONL is appended to FILE; a Parquet file
    /// cannot be appended to, so FILE is written anew and holds only the samples after the cursor.
    #[arg(long, value_name = "CURSOR")]
    after: Option<String>,
    /// Address of a running orchestrator; without it one runs in this process on the store `kforge run` uses.
    #[arg(long, value_name = "URL", conflicts_with = "work_dir")]
    addr: Option<String>,
    /// The store to read without --addr: DIR/orchestrator.db, as `kforge run --work-dir DIR` writes it; by default
    /// the configured store, else ~/.local/state/kforge/orchestrator.db.
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
    /// File holding the bearer token to present.
    #[arg(long, value_name = "FILE", env = "KFORGE_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// CA certificate that signs the server's certificate, for https addresses.
    #[arg(long, value_name = "FILE")]
    ca_file: Option<PathBuf>,
}

impl ExportArgs {
    /// The format asked for, else the one FILE's extension names; Parquet on stdout is refused.
    fn format(&self) -> anyhow::Result<Format> {
        let named_parquet = self.out.extension().is_some_and(|extension| extension.eq_ignore_ascii_case("parquet"));
        let format = self.format.unwrap_or(if named_parquet { Format::Parquet } else { Format::Jsonl });
        if format == Format::Parquet && self.out.as_os_str() == "-" {
            bail!(
                "parquet cannot be written to stdout (--out -): readers seek to its footer, which is written last; \
                 name a file"
            );
        }
        Ok(format)
    }
}

/// Runs `kforge export`: prints the number of samples written and the last cursor on stderr.
pub async fn command(config: &MeshConfig, args: ExportArgs) -> anyhow::Result<()> {
    let format = args.format()?;
    let client_config = ClientConfig {
        tls_ca_file: args.ca_file.clone(),
        tls_domain: None,
        auth: AuthConfig { token_file: args.token_file.clone(), token_env: None },
    };
    let (channel, mesh, searched) = match &args.addr {
        Some(addr) => {
            let searched = format!("the orchestrator at {}", redact_url(addr));
            (client::connect(addr, &client_config).await?, None, searched)
        }
        None => {
            let mut config = config.clone();
            store_for_run(&mut config, args.work_dir.as_deref());
            // The in-command orchestrator serves this export alone: no HTTP port.
            config.orchestrator.http.listen.clear();
            let store = config.orchestrator.store_url();
            let searched = format!("the store {}", redact_url(&store));
            // A store file that is not there holds no job: say so rather than create an empty one.
            if sqlite_file(&store).is_some_and(|file| !file.exists()) {
                let missing = CallError::Rpc {
                    code: kforge_server::code_name(tonic::Code::NotFound),
                    message: format!("job `{}` not found in {searched} (no such file)", args.job_id),
                };
                return Err(anyhow::Error::new(missing).context("exporting the samples"));
            }
            let mesh = Mesh::start(&[Service::Orchestrator], &config, true).await?;
            let address = mesh.address(Service::Orchestrator).context("the orchestrator runs")?.to_owned();
            (client::connect(&address, &client_config).await?, Some(mesh), searched)
        }
    };
    let written = write(OrchestratorClient::new(channel), &args, format, &searched).await;
    if let Some(mesh) = mesh {
        mesh.shutdown().await?;
    }
    let (samples, cursor) = written?;
    eprintln!("{samples} samples written to {}; last cursor {cursor:?}", args.out.display());
    Ok(())
}

/// Samples handed to the writer at a time: encoding and file writes are blocking work, done off the runtime's
/// threads (which serve the stream, and the orchestrator when it runs in this process).
const BATCH: usize = 256;

/// Writes the samples; `searched` names where a job that is not found was looked for.
async fn write(
    mut client: OrchestratorClient<client::Channel>,
    args: &ExportArgs,
    format: Format,
    searched: &str,
) -> anyhow::Result<(u64, String)> {
    let request = pb::ExportSamplesRequest {
        job_id: args.job_id.clone(),
        cursor: args.after.clone().unwrap_or_default(),
        limit: 0,
    };
    let mut stream = client
        .export_samples(request)
        .await
        .map_err(|status| found_nowhere(status, searched))
        .context("exporting the samples")?
        .into_inner();
    let mut sink = Sink::open(&args.out, format, args.after.is_some())?;
    let (mut samples, mut cursor) = (0, String::new());
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        let next = stream.next().await.transpose().map_err(CallError::from).context("reading the samples")?;
        let ended = next.is_none();
        if let Some(sample) = next {
            samples += 1;
            cursor.clone_from(&sample.cursor);
            batch.push(sample);
        }
        if batch.len() == BATCH || (ended && !batch.is_empty()) {
            let taken = std::mem::take(&mut batch);
            sink = tokio::task::spawn_blocking(move || sink.write(taken).map(|()| sink))
                .await
                .context("the writer thread")??;
        }
        if ended {
            break;
        }
    }
    tokio::task::spawn_blocking(move || sink.finish()).await.context("the writer thread")??;
    Ok((samples, cursor))
}

/// A call's error; NOT_FOUND (the job) says where it was looked for.
fn found_nowhere(status: tonic::Status, searched: &str) -> CallError {
    match CallError::from(status) {
        CallError::Rpc { code, message } if code == kforge_server::code_name(tonic::Code::NotFound) => {
            CallError::Rpc { code, message: format!("{message} in {searched}") }
        }
        other => other,
    }
}

/// Where the samples go.
enum Sink {
    Jsonl(Box<dyn Write + Send>),
    /// JSONL on stdout: a reader that went away ends the export quietly (`crate::stdout`).
    Stdout(BufWriter<std::io::Stdout>),
    // Boxed: the writer's buffers are large, and the sink moves to the writer thread and back for each batch.
    Parquet(Box<parquet::SampleWriter<BufWriter<File>>>, PartialFile),
}

impl Sink {
    /// JSONL goes to `out` (appended to when `append`) or stdout; Parquet to a partial file beside `out`.
    fn open(out: &Path, format: Format, append: bool) -> anyhow::Result<Self> {
        let cannot_write = || format!("cannot write {}", out.display());
        Ok(match format {
            Format::Jsonl if out.as_os_str() == "-" => Self::Stdout(BufWriter::new(std::io::stdout())),
            Format::Jsonl => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(append)
                    .truncate(!append)
                    .open(out)
                    .with_context(cannot_write)?;
                Self::Jsonl(Box::new(BufWriter::new(file)))
            }
            Format::Parquet => {
                let partial = PartialFile::beside(out)?;
                let file = File::create(&partial.path).with_context(cannot_write)?;
                Self::Parquet(Box::new(parquet::SampleWriter::new(BufWriter::new(file))?), partial)
            }
        })
    }

    fn write(&mut self, samples: Vec<pb::Sample>) -> anyhow::Result<()> {
        for sample in samples {
            match self {
                Self::Jsonl(out) => writeln!(out, "{}", sample_json(&sample)?)?,
                Self::Stdout(out) => writeln!(out, "{}", sample_json(&sample)?).map_err(crate::stdout::written)?,
                Self::Parquet(writer, _) => writer.write(sample)?,
            }
        }
        Ok(())
    }

    fn finish(self) -> anyhow::Result<()> {
        match self {
            Self::Jsonl(mut out) => out.flush()?,
            Self::Stdout(mut out) => out.flush().map_err(crate::stdout::written)?,
            Self::Parquet(writer, partial) => {
                let file = writer.finish()?.into_inner().map_err(std::io::IntoInnerError::into_error)?;
                file.sync_all()?;
                partial.commit()?;
            }
        }
        Ok(())
    }
}

/// A Parquet file written beside its destination and renamed onto it once complete: a file without its footer
/// cannot be read, so a failed export removes it and leaves the destination as it was.
#[derive(Debug)]
struct PartialFile {
    path: PathBuf,
    destination: PathBuf,
    committed: bool,
}

impl PartialFile {
    fn beside(destination: &Path) -> anyhow::Result<Self> {
        let name = destination.file_name().with_context(|| format!("{} names no file", destination.display()))?;
        let mut partial = name.to_owned();
        partial.push(format!(".partial-{}", std::process::id()));
        Ok(Self { path: destination.with_file_name(partial), destination: destination.to_owned(), committed: false })
    }

    fn commit(mut self) -> anyhow::Result<()> {
        std::fs::rename(&self.path, &self.destination)
            .with_context(|| format!("cannot write {}", self.destination.display()))?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A sample as one line of proto3 JSON, with the proto's snake_case field names and every field present (zeros
/// included) so that a trainer reads the same keys on every line; optional fields not computed yet (`score`,
/// `return_value`, `advantage`, `keep`) are absent.
pub fn sample_json(sample: &pb::Sample) -> anyhow::Result<String> {
    message_json("kforge.v1.Sample", sample)
}

/// `message` as proto3 JSON in the form of [`sample_json`]; `name` is its full name in the contract.
fn message_json(name: &str, message: &impl prost::Message) -> anyhow::Result<String> {
    let descriptor =
        crate::call::descriptors().get_message_by_name(name).with_context(|| format!("{name} is in the contract"))?;
    let message = prost_reflect::DynamicMessage::decode(descriptor, message.encode_to_vec().as_slice())?;
    let options = prost_reflect::SerializeOptions::new().use_proto_field_name(true).skip_default_fields(false);
    let mut line = Vec::new();
    message.serialize_with_options(&mut serde_json::Serializer::new(&mut line), &options)?;
    Ok(String::from_utf8(line)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_not_found_names_where_it_was_looked_for() {
        let status = tonic::Status::not_found("job `job-9` not found");
        let error = found_nowhere(status, "the store /w/orchestrator.db").to_string();
        assert_eq!(error, "NOT_FOUND: job `job-9` not found in the store /w/orchestrator.db");
        let other = found_nowhere(tonic::Status::unavailable("down"), "the store x").to_string();
        assert_eq!(other, "UNAVAILABLE: down", "other codes are as the server said");
    }
}
