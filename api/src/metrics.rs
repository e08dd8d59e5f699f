//! The Prometheus text exposition format (0.0.4) that virt-controller and virt-handler serve on
//! `/metrics`, and the metric both export under KubeVirt's name (`kubevirt_vmi_phase_count`).
//!
//! Written by hand: the values are read from caches and `/proc` at scrape time, so a client
//! library's registry of live metric objects would only be filled and emptied on each scrape.

use std::fmt::{self, Write as _};

/// The `content-type` of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// A metric family's type, as its `# TYPE` line names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        }
    }
}

/// An exposition text being written, family by family.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

/// One family's samples; made by [`Exposition::family`].
#[derive(Debug)]
pub struct Family<'a> {
    out: &'a mut String,
    name: &'a str,
}

impl Exposition {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts a family with its `# HELP` and `# TYPE` lines; its samples follow.
    pub fn family<'a>(&'a mut self, name: &'a str, kind: Kind, help: &str) -> Family<'a> {
        let _ = writeln!(
            self.out,
            "# HELP {name} {help}\n# TYPE {name} {}",
            kind.as_str()
        );
        Family {
            out: &mut self.out,
            name,
        }
    }

    /// The text.
    pub fn finish(self) -> String {
        self.out
    }
}

impl Family<'_> {
    /// One sample line, `name{key="value",...} value` (no braces without labels); label values
    /// are escaped.
    pub fn sample(&mut self, labels: &[(&str, &str)], value: impl fmt::Display) -> &mut Self {
        self.out.push_str(self.name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{key}=\"");
                escape_into(self.out, v);
                self.out.push('"');
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
        self
    }
}

/// A label value as the text format wants it: `\`, `"` and newlines escaped.
fn escape_into(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// KubeVirt's `kubevirt_vmi_phase_count`: one sample per (node, phase, count); the phase is
/// lower-cased, as KubeVirt reports it.
pub fn vmi_phase_count<'a>(
    text: &mut Exposition,
    counts: impl IntoIterator<Item = (&'a str, &'a str, usize)>,
) {
    let mut family = text.family(
        "kubevirt_vmi_phase_count",
        Kind::Gauge,
        "Sum of VMIs per phase and node.",
    );
    for (node, phase, n) in counts {
        family.sample(&[("node", node), ("phase", &phase.to_lowercase())], n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;

    #[test]
    fn families_and_samples() {
        let mut text = Exposition::new();
        text.family("up", Kind::Gauge, "Whether it runs.")
            .sample(&[], 1);
        text.family("bytes_total", Kind::Counter, "Bytes.")
            .sample(&[("a", "x"), ("b", "y")], 1.5)
            .sample(&[("a", "z"), ("b", "")], 0.0);
        vmi_phase_count(&mut text, [("node-0", "Running", 2)]);
        assert_eq!(
            text.finish(),
            "# HELP up Whether it runs.\n# TYPE up gauge\nup 1\n\
             # HELP bytes_total Bytes.\n# TYPE bytes_total counter\n\
             bytes_total{a=\"x\",b=\"y\"} 1.5\nbytes_total{a=\"z\",b=\"\"} 0\n\
             # HELP kubevirt_vmi_phase_count Sum of VMIs per phase and node.\n\
             # TYPE kubevirt_vmi_phase_count gauge\n\
             kubevirt_vmi_phase_count{node=\"node-0\",phase=\"running\"} 2\n"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let mut text = Exposition::new();
        text.family("m", Kind::Gauge, "M.")
            .sample(&[("v", "a\"b\\c\nd")], 1);
        assert!(
            text.finish().ends_with("m{v=\"a\\\"b\\\\c\\nd\"} 1\n"),
            "escaped"
        );
    }
}
