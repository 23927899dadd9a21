//! Reading model output: the reasoning split from the answer, the last fenced code block, the candidate kernel.
//!
//! The gateway splits reasoning when a backend leaves it in the text, the orchestrator takes the kernel out of
//! the answer, and the reward service's diagnostics flag answers without one; all three call these functions, so a
//! response is read one way everywhere. Pure functions over `&str`, no allocation beyond what they return.

/// Where reasoning ends and the answer begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split<'a> {
    /// The reasoning; empty when the text has none that can be told apart.
    pub reasoning: &'a str,
    /// The answer.
    pub answer: &'a str,
    /// Whether a reasoning block was found (a `<think>` block, closed or not).
    pub found: bool,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

/// Splits `text` at a leading `<think>...</think>` block (leading whitespace allowed). An unclosed block is all
/// reasoning and no answer (the model ran out of tokens while thinking). A text with a lone `</think>` (the
/// chat template opened the block in the prompt, as Qwen3 and DeepSeek-R1 templates do) splits there. Otherwise
/// there is no reasoning and the whole text is the answer.
pub fn split_reasoning(text: &str) -> Split<'_> {
    let trimmed = text.trim_start();
    if let Some(rest) = trimmed.strip_prefix(THINK_OPEN) {
        return match rest.find(THINK_CLOSE) {
            Some(end) => Split { reasoning: &rest[..end], answer: &rest[end + THINK_CLOSE.len()..], found: true },
            None => Split { reasoning: rest, answer: "", found: true },
        };
    }
    if let Some(end) = text.find(THINK_CLOSE)
        && !text[..end].contains(THINK_OPEN)
    {
        return Split { reasoning: &text[..end], answer: &text[end + THINK_CLOSE.len()..], found: true };
    }
    Split { reasoning: "", answer: text, found: false }
}

/// The fenced code blocks of `text` (```` ``` ```` fences, any info string), in order, without their fences. An
/// unclosed final block counts: a truncated answer may still hold a whole program.
pub fn fenced_blocks(text: &str) -> impl Iterator<Item = &str> {
    let mut blocks = Vec::new();
    let mut block_start: Option<usize> = None;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with("```") {
            match block_start.take() {
                Some(start) => blocks.push(&text[start..offset]),
                None => block_start = Some(offset + line.len()),
            }
        }
        offset += line.len();
    }
    if let Some(start) = block_start {
        blocks.push(&text[start..]);
    }
    blocks.into_iter()
}

/// The last fenced code block of `text`, if any.
pub fn last_fenced_block(text: &str) -> Option<&str> {
    fenced_blocks(text).last()
}

/// The text of `answer` outside its fenced code blocks (an unclosed final block included), lines trimmed, blank
/// lines dropped: what a model wrote about its code, such as a summary of its change.
pub fn prose(answer: &str) -> String {
    let mut inside = false;
    let mut kept = Vec::new();
    for line in answer.lines() {
        if line.trim_start().starts_with("```") {
            inside = !inside;
            continue;
        }
        if !inside && !line.trim().is_empty() {
            kept.push(line.trim());
        }
    }
    kept.join("\n")
}

/// The candidate kernel in an answer: the last fenced code block that defines `class ModelNew` (followed by `(`
/// or `:`).
pub fn extract_kernel(answer: &str) -> Option<&str> {
    fenced_blocks(answer).filter(|block| defines_model_new(block)).last()
}

fn defines_model_new(block: &str) -> bool {
    block.lines().any(|line| {
        line.trim_start()
            .strip_prefix("class ModelNew")
            .is_some_and(|rest| rest.starts_with('(') || rest.starts_with(':'))
    })
}

/// How a response breaks the strict format (Kevin's): the shape the prompts ask for is a change summary in prose
/// and the whole `ModelNew` in one fenced block, after reasoning that ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatError {
    /// The backend stopped at the token limit (`finish_reason` `length`).
    Truncated,
    /// A `<think>` block never closed: the answer is missing.
    ReasoningUnclosed,
    /// No fenced code block in the answer.
    NoCodeBlock,
    /// More than one fenced code block in the answer.
    SeveralCodeBlocks(usize),
    /// The one block does not define `class ModelNew`.
    NoModelNew,
    /// No prose beside the code: no summary of the change.
    NoSummary,
    /// The one block never closed.
    UnclosedCodeBlock,
}

impl std::fmt::Display for FormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FormatError::Truncated => write!(f, "the response was cut at the token limit"),
            FormatError::ReasoningUnclosed => write!(f, "the reasoning (<think>) never closed, so there is no answer"),
            FormatError::NoCodeBlock => write!(f, "the answer has no fenced code block"),
            FormatError::SeveralCodeBlocks(n) => {
                write!(f, "the answer has {n} fenced code blocks; exactly one, with the whole ModelNew, is expected")
            }
            FormatError::NoModelNew => write!(f, "the code block does not define class ModelNew"),
            FormatError::NoSummary => write!(f, "the answer has no summary of the change beside its code"),
            FormatError::UnclosedCodeBlock => write!(f, "the code block is not closed"),
        }
    }
}

/// Checks a response against the strict format: not cut at the token limit, reasoning closed (when `reasoning`
/// came separated by the backend, `text` is the answer), some prose outside the code, and exactly one closed
/// fenced block, which defines `class ModelNew`.
pub fn check_strict_format(text: &str, finish_reason: &str) -> Result<(), FormatError> {
    if finish_reason == "length" {
        return Err(FormatError::Truncated);
    }
    let split = split_reasoning(text);
    if split.found && !text.contains(THINK_CLOSE) {
        return Err(FormatError::ReasoningUnclosed);
    }
    let fences = split.answer.lines().filter(|line| line.trim_start().starts_with("```")).count();
    let blocks: Vec<&str> = fenced_blocks(split.answer).collect();
    match blocks.as_slice() {
        [] => return Err(FormatError::NoCodeBlock),
        [_] if fences % 2 == 1 => return Err(FormatError::UnclosedCodeBlock),
        [block] if !defines_model_new(block) => return Err(FormatError::NoModelNew),
        [_] => {}
        several => return Err(FormatError::SeveralCodeBlocks(several.len())),
    }
    if !prose(split.answer).chars().any(char::is_alphabetic) {
        return Err(FormatError::NoSummary);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_strict_format_takes_one_block_with_a_summary_and_names_each_breach() {
        let kernel = "```python\nclass ModelNew(nn.Module):\n    pass\n```\n";
        let good = format!("<think>Okay, plan.</think>I fused the two loops.\n{kernel}");
        assert_eq!(check_strict_format(&good, "stop"), Ok(()));
        assert_eq!(check_strict_format(&format!("Fused.\n{kernel}"), ""), Ok(()), "no reasoning block is fine");
        let cases = [
            (good.clone(), "length", FormatError::Truncated),
            (format!("<think>Okay, {kernel}"), "stop", FormatError::ReasoningUnclosed),
            ("I fused them.".to_owned(), "stop", FormatError::NoCodeBlock),
            (format!("Two.\n{kernel}{kernel}"), "stop", FormatError::SeveralCodeBlocks(2)),
            ("Mine.\n```python\nclass Model(nn.Module): pass\n```".to_owned(), "stop", FormatError::NoModelNew),
            (kernel.to_owned(), "stop", FormatError::NoSummary),
            ("Cut.\n```python\nclass ModelNew(nn.Module):\n".to_owned(), "stop", FormatError::UnclosedCodeBlock),
        ];
        for (text, finish, expected) in cases {
            assert_eq!(check_strict_format(&text, finish), Err(expected), "{text}");
        }
    }

    #[test]
    fn splits_a_leading_think_block() {
        let split = split_reasoning("  <think>Okay, so.</think>\nThe answer.");
        assert_eq!((split.reasoning, split.answer, split.found), ("Okay, so.", "\nThe answer.", true));
    }

    #[test]
    fn an_unclosed_block_is_all_reasoning() {
        let split = split_reasoning("<think>Okay, still thinking");
        assert_eq!((split.reasoning, split.answer), ("Okay, still thinking", ""));
    }

    #[test]
    fn a_lone_closing_tag_splits_where_the_template_opened_the_block() {
        let split = split_reasoning("Okay, the prompt opened it.</think>Answer");
        assert_eq!((split.reasoning, split.answer, split.found), ("Okay, the prompt opened it.", "Answer", true));
    }

    #[test]
    fn text_without_reasoning_is_all_answer() {
        let split = split_reasoning("Just an answer with </b> html");
        assert_eq!((split.reasoning, split.answer, split.found), ("", "Just an answer with </b> html", false));
        let inner = split_reasoning("Answer <think>later</think> text");
        assert!(!inner.found, "a block that does not lead is not reasoning");
    }

    #[test]
    fn prose_is_the_text_outside_code_blocks() {
        let answer = "I fused the two loops.\n\n```python\nclass ModelNew: pass\n```\n  Then vectorised.  \n```cpp\nx";
        assert_eq!(prose(answer), "I fused the two loops.\nThen vectorised.");
        assert_eq!(prose("```python\nclass ModelNew: pass\n```"), "");
    }

    #[test]
    fn last_fenced_block_and_unclosed_blocks() {
        assert_eq!(last_fenced_block("a\n```\none\n```\nb\n```cpp\ntwo\n```\n"), Some("two\n"));
        assert_eq!(last_fenced_block("```python\nunclosed"), Some("unclosed"));
        assert_eq!(last_fenced_block("no fences here"), None);
    }

    #[test]
    fn extracts_the_last_block_defining_model_new() {
        let answer = "```python\nclass ModelNew(nn.Module): v1\n```\ntext\n```\nprint(1)\n```\n```py\nclass ModelNew(nn.Module): v2\n```";
        assert_eq!(extract_kernel(answer), Some("class ModelNew(nn.Module): v2\n"));
        assert_eq!(extract_kernel("class ModelNew(nn.Module): no fence"), None);
        assert_eq!(extract_kernel("```\nclass ModelNewer(x): pass\n```"), None);
        assert_eq!(extract_kernel("```python\nclass ModelNew:\n  x = 1"), Some("class ModelNew:\n  x = 1"));
    }
}
