//! The Prometheus registry of a vnfarm binary (each has one `metrics.rs` registering its families
//! into an explicit registry): the `vnfarm_` prefix, the text format for `/metrics`, and the test
//! that a binary exports exactly the families it lists.

/// The registry a binary's metrics live in: every name gets the `vnfarm_` prefix.
pub fn registry() -> prometheus::Registry {
    prometheus::Registry::new_custom(Some("vnfarm".into()), None)
        .expect("the prefix 'vnfarm' is a valid metric name")
}

/// `registry` in the Prometheus text format, for `/metrics`.
pub fn render(registry: &prometheus::Registry) -> String {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    prometheus::TextEncoder::new()
        .encode(&registry.gather(), &mut buf)
        .expect("text encoding into a Vec cannot fail");
    String::from_utf8(buf).expect("the Prometheus text format is UTF-8")
}

/// A metric family a binary must export: name, type, and its labels in the text format's order.
pub type MetricFamily<'a> = (&'a str, prometheus::proto::MetricType, &'a [&'a str]);

/// For the binaries' metric tests: `registry` exports exactly `families`, each with its type, a
/// help text and its labels, and the text rendering declares each type. Returns the rendering.
pub fn check_families(registry: &prometheus::Registry, families: &[MetricFamily]) -> String {
    let gathered = registry.gather();
    let names: Vec<&str> = gathered.iter().map(|f| f.name()).collect();
    for (name, kind, labels) in families {
        let family = gathered
            .iter()
            .find(|f| f.name() == *name)
            .unwrap_or_else(|| panic!("{name} is not exported; exported: {names:?}"));
        assert_eq!(family.get_field_type(), *kind, "{name}");
        assert!(!family.help().is_empty(), "{name} has no help");
        for metric in family.get_metric() {
            // The text format sorts a series' labels by name.
            let found: Vec<&str> = metric.get_label().iter().map(|l| l.name()).collect();
            assert_eq!(found, *labels, "{name}");
        }
    }
    for name in &names {
        assert!(
            families.iter().any(|(n, ..)| n == name),
            "{name} is exported but not listed here (nor, probably, in the README)"
        );
    }
    let text = render(registry);
    for (name, kind, _) in families {
        let kind = format!("{kind:?}").to_lowercase();
        assert!(text.contains(&format!("# TYPE {name} {kind}\n")), "{text}");
    }
    text
}
