//! Nsight Compute's raw page as CSV (`ncu --csv --page raw --print-units base`): one row per profiled launch,
//! after a preamble of `==PROF==` lines and whatever the profiled program printed, a header row (starting `"ID"`)
//! and a row of units. Identity columns (process, kernel name, block and grid size...) come first; every column
//! after them is a metric whose value is a number (with thousands separators) or, for a few, text.

use std::collections::BTreeMap;

/// Columns of the raw page that name the launch rather than measure it.
const IDENTITY: &[&str] = &[
    "ID",
    "Process ID",
    "Process Name",
    "Host Name",
    "Kernel Name",
    "Context",
    "Stream",
    "Block Size",
    "Grid Size",
    "Device",
    "CC",
];

/// One metric's value and unit, as Nsight Compute reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    pub value: f64,
    pub unit: String,
}

/// One profiled launch of a kernel.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// Nsight Compute's launch number within the process.
    pub id: u32,
    /// The kernel's demangled name with its parameter list, as ncu prints it.
    pub kernel: String,
    pub block_size: String,
    pub grid_size: String,
    /// Numeric metrics by name.
    pub metrics: BTreeMap<String, Metric>,
}

impl Launch {
    /// A metric's value, if it was collected and is a number.
    pub fn value(&self, name: &str) -> Option<f64> {
        self.metrics.get(name).map(|metric| metric.value)
    }

    /// The kernel's name without its parameter list (`fma_chains` for `fma_chains(float *, int)`).
    pub fn short_name(&self) -> &str {
        self.kernel.split('(').next().unwrap_or(&self.kernel).trim()
    }
}

/// Why a raw page could not be read.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ParseError {
    #[error("no header row (a row starting with \"ID\"): ncu profiled nothing, or this is not --page raw --csv")]
    NoHeader,
    #[error("no units row after the header")]
    NoUnits,
    #[error("row {row}: {problem}")]
    Row { row: usize, problem: String },
}

/// Reads every launch of a raw page. Text values (a few metrics are names, not numbers) are left out.
pub fn parse_raw(text: &str) -> Result<Vec<Launch>, ParseError> {
    // The preamble is not CSV (program output, ==PROF== lines): the table starts at its header line.
    let start = text.lines().position(|line| line.starts_with("\"ID\"")).ok_or(ParseError::NoHeader)?;
    let table: String = text.lines().skip(start).collect::<Vec<_>>().join("\n");
    let mut reader = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(table.as_bytes());
    let mut records = reader.records();
    let header = records.next().ok_or(ParseError::NoHeader)?.map_err(|e| row_error(0, e))?;
    let units = records.next().ok_or(ParseError::NoUnits)?.map_err(|e| row_error(1, e))?;
    let column = |name: &str| header.iter().position(|h| h == name);
    let (id, kernel, block, grid) = (column("ID"), column("Kernel Name"), column("Block Size"), column("Grid Size"));
    let mut launches = Vec::new();
    for (index, record) in records.enumerate() {
        let row = index + 2;
        let record = record.map_err(|e| row_error(row, e))?;
        let field = |at: Option<usize>| at.and_then(|at| record.get(at)).unwrap_or_default().to_owned();
        let id = field(id).parse().map_err(|_| ParseError::Row { row, problem: "its ID is not a number".into() })?;
        let mut metrics = BTreeMap::new();
        for (at, name) in header.iter().enumerate() {
            if IDENTITY.contains(&name) {
                continue;
            }
            let Some(value) = record.get(at).and_then(number) else { continue };
            metrics.insert(name.to_owned(), Metric { value, unit: units.get(at).unwrap_or_default().to_owned() });
        }
        launches.push(Launch { id, kernel: field(kernel), block_size: field(block), grid_size: field(grid), metrics });
    }
    Ok(launches)
}

fn row_error(row: usize, error: csv::Error) -> ParseError {
    ParseError::Row { row, problem: error.to_string() }
}

/// A value as a number: `1,173,280` is 1173280; text and empty cells are not numbers.
fn number(cell: &str) -> Option<f64> {
    let plain: String = cell.trim().chars().filter(|c| *c != ',').collect();
    if plain.is_empty() {
        return None;
    }
    plain.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_lose_their_separators_and_text_is_not_a_number() {
        assert_eq!(number("1,173,280"), Some(1_173_280.0));
        assert_eq!(number("81.51"), Some(81.51));
        assert_eq!(number(""), None);
        assert_eq!(number("SM"), None);
    }

    #[test]
    fn a_page_without_a_table_is_an_error_that_says_so() {
        assert_eq!(parse_raw("==PROF== No kernels were profiled.\n"), Err(ParseError::NoHeader));
        assert_eq!(parse_raw("\"ID\",\"Kernel Name\"\n"), Err(ParseError::NoUnits));
    }

    #[test]
    fn the_preamble_is_skipped_and_each_row_is_a_launch() {
        let page = "hello from the program\n==PROF== Connected\n\
            \"ID\",\"Kernel Name\",\"Block Size\",\"Grid Size\",\"gpu__time_duration.sum\",\"device__attribute_display_name\"\n\
            \"\",\"\",\"\",\"\",\"ns\",\"\"\n\
            \"0\",\"k(int)\",\"(256, 1, 1)\",\"(8, 1, 1)\",\"1,024\",\"NVIDIA H100\"\n\
            \"1\",\"k(int)\",\"(256, 1, 1)\",\"(8, 1, 1)\",\"2,048\",\"NVIDIA H100\"\n";
        let launches = parse_raw(page).expect("parses");
        assert_eq!(launches.len(), 2);
        assert_eq!(launches[1].id, 1);
        assert_eq!(launches[0].short_name(), "k");
        assert_eq!(launches[1].metrics["gpu__time_duration.sum"], Metric { value: 2048.0, unit: "ns".into() });
        assert!(!launches[0].metrics.contains_key("device__attribute_display_name"), "text is not a metric value");
    }
}
