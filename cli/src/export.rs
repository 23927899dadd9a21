//! `kforge export JOB --out samples.jsonl`: a job's training samples (Orchestrator/ExportSamples) as JSONL, one
//! proto3 JSON object (`kforge.v1.Sample`) per line. Without `--addr`, an orchestrator runs in this process on the
//! configured store (the default one `kforge run` writes to), resuming nothing.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_server::client::{self, ClientConfig};
use kforge_server::config::AuthConfig;
use tokio_stream::StreamExt as _;

use crate::call::CallError;
use crate::mesh::{Mesh, MeshConfig, Service};

/// `kforge export`'s arguments.
#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// The job.
    job_id: String,
    /// The JSONL file to write (`-` for stdout).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// Start after the sample with this cursor (each line's `cursor`): appends to FILE instead of replacing it.
    #[arg(long, value_name = "CURSOR")]
    after: Option<String>,
    /// Address of a running orchestrator; without it one runs in this process on the configured store.
    #[arg(long, value_name = "URL")]
    addr: Option<String>,
    /// File holding the bearer token to present.
    #[arg(long, value_name = "FILE", env = "KFORGE_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// CA certificate that signs the server's certificate, for https addresses.
    #[arg(long, value_name = "FILE")]
    ca_file: Option<PathBuf>,
}

/// Runs `kforge export`: prints the number of samples written and the last cursor on stderr.
pub async fn command(config: &MeshConfig, args: ExportArgs) -> anyhow::Result<()> {
    let client_config = ClientConfig {
        tls_ca_file: args.ca_file.clone(),
        tls_domain: None,
        auth: AuthConfig { token_file: args.token_file.clone(), token_env: None },
    };
    let (channel, mesh) = match &args.addr {
        Some(addr) => (client::connect(addr, &client_config).await?, None),
        None => {
            let mut config = config.clone();
            config.orchestrator.resume_on_start = false;
            let mesh = Mesh::start(&[Service::Orchestrator], &config, true).await?;
            let address = mesh.address(Service::Orchestrator).context("the orchestrator runs")?.to_owned();
            (client::connect(&address, &client_config).await?, Some(mesh))
        }
    };
    let written = write(OrchestratorClient::new(channel), &args).await;
    if let Some(mesh) = mesh {
        mesh.shutdown().await?;
    }
    let (samples, cursor) = written?;
    eprintln!("{samples} samples written to {}; last cursor {cursor:?}", args.out.display());
    Ok(())
}

async fn write(mut client: OrchestratorClient<client::Channel>, args: &ExportArgs) -> anyhow::Result<(u64, String)> {
    let request = pb::ExportSamplesRequest {
        job_id: args.job_id.clone(),
        cursor: args.after.clone().unwrap_or_default(),
        limit: 0,
    };
    let mut stream =
        client.export_samples(request).await.map_err(CallError::from).context("exporting the samples")?.into_inner();
    let mut out: Box<dyn std::io::Write> = if args.out.as_os_str() == "-" {
        Box::new(std::io::stdout().lock())
    } else {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(args.after.is_some())
            .truncate(args.after.is_none())
            .open(&args.out)
            .with_context(|| format!("cannot write {}", args.out.display()))?;
        Box::new(std::io::BufWriter::new(file))
    };
    let (mut samples, mut cursor) = (0, String::new());
    while let Some(sample) = stream.next().await {
        let sample = sample.map_err(CallError::from).context("reading the samples")?;
        writeln!(out, "{}", sample_json(&sample)?)?;
        samples += 1;
        cursor = sample.cursor;
    }
    out.flush()?;
    Ok((samples, cursor))
}

/// A sample as one line of proto3 JSON, with the proto's snake_case field names and every field present (zeros
/// included) so that a trainer reads the same keys on every line; optional fields not computed yet (`score`,
/// `return_value`, `advantage`, `keep`) are absent.
pub fn sample_json(sample: &pb::Sample) -> anyhow::Result<String> {
    let descriptor = crate::call::descriptors()
        .get_message_by_name("kforge.v1.Sample")
        .context("kforge.v1.Sample is in the contract")?;
    let message = prost_reflect::DynamicMessage::decode(descriptor, prost::Message::encode_to_vec(sample).as_slice())?;
    let options = prost_reflect::SerializeOptions::new().use_proto_field_name(true).skip_default_fields(false);
    let mut line = Vec::new();
    message.serialize_with_options(&mut serde_json::Serializer::new(&mut line), &options)?;
    Ok(String::from_utf8(line)?)
}
