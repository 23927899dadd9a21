//! Findings in their proto form: the static checks' and the census's, and those seen at run time (all hacks).

use kforge_proto::v1 as pb;
use kforge_static_checks::{Category, Finding};

/// A run-time finding of category hack.
pub fn hack_finding(code: impl Into<String>, message: impl Into<String>) -> pb::Finding {
    pb::Finding { code: code.into(), message: message.into(), line: 0, category: pb::FindingCategory::Hack as i32 }
}

pub fn finding_proto(finding: &Finding) -> pb::Finding {
    let category = match finding.category {
        Category::Hack => pb::FindingCategory::Hack,
        Category::Policy => pb::FindingCategory::Policy,
        Category::Notice => pb::FindingCategory::Notice,
    };
    pb::Finding {
        code: finding.code.into(),
        message: finding.message.clone(),
        line: finding.line,
        category: category as i32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn findings_keep_their_category() {
        let finding = Finding {
            code: "policy.torch_op",
            message: "uses torch.matmul".into(),
            line: 7,
            category: Category::Policy,
        };
        let proto = finding_proto(&finding);
        assert_eq!((proto.code.as_str(), proto.line), ("policy.torch_op", 7));
        assert_eq!(proto.category, pb::FindingCategory::Policy as i32);
        assert_eq!(hack_finding("x", "y").category, pb::FindingCategory::Hack as i32);
    }
}
