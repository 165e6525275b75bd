//! The `[amqp]` configuration section, shared by both binaries so their declarations agree.

use serde::Deserialize;

/// Every key may be left out: `#[serde(default)]` takes it from [`AmqpConfig::default`].
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AmqpConfig {
    /// `amqp://user:password@host:port/vhost`: the broker of a single-node installation. The
    /// password is never logged.
    pub url: String,
    /// The nodes of a broker cluster, in place of `url`: each connection starts at a random one
    /// (so a fleet spreads over the cluster) and moves to the next when a node fails. In the
    /// environment a TOML array: `VNFARM_AMQP__URLS='["amqp://…@10.0.0.1:5672/%2f", …]'`.
    pub urls: Vec<String>,
    /// Prefix of every exchange and queue name (`vnfarm`); lets several installations share a broker.
    pub prefix: String,
    /// Deliveries of one message before the broker dead-letters it (RabbitMQ 3.x quorum queues have
    /// no limit unless one is set).
    pub delivery_limit: u32,
    /// Size cap of the event stream (the job history).
    pub events_max_bytes: u64,
    /// Age cap of the event stream, in RabbitMQ's syntax (`7D`, `24h`).
    pub events_max_age: String,
    /// Longest wait between reconnection attempts, in milliseconds.
    pub max_backoff_ms: u64,
    /// Longest wait for the broker's confirm of one publish. A channel can stop receiving confirms
    /// for good after a cluster election (fleet.md, client trap 2), so a confirm that does not come
    /// in time fails the publish and the session is opened again on fresh channels.
    pub confirm_timeout_ms: u64,
    /// Whether a worker declares the shared exchanges and queues at every session, as the
    /// scheduler always does. On by default, so a worker that starts before any scheduler finds
    /// them; off where the broker users of deploy/rabbitmq/definitions.json are used, whose
    /// worker may configure only its own queue. The scheduler ignores it.
    pub declare_topology: bool,
}

/// The broker of a single-node installation on this machine, RabbitMQ's own guest user.
const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

impl Default for AmqpConfig {
    fn default() -> Self {
        Self {
            url: DEFAULT_URL.into(),
            urls: Vec::new(),
            prefix: "vnfarm".into(),
            delivery_limit: 3,
            events_max_bytes: 1 << 30,
            events_max_age: "7D".into(),
            max_backoff_ms: 5_000,
            confirm_timeout_ms: 10_000,
            declare_topology: true,
        }
    }
}

impl AmqpConfig {
    /// Checks without I/O; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        let amqp = |url: &str| url.starts_with("amqp://") || url.starts_with("amqps://");
        if !amqp(&self.url) {
            return Err("amqp.url: must start with amqp:// or amqps://".into());
        }
        if !self.urls.is_empty() && self.url != DEFAULT_URL {
            return Err(
                "amqp.urls: set either url (one node) or urls (a cluster), not both".into(),
            );
        }
        if let Some(i) = self.urls.iter().position(|u| !amqp(u)) {
            return Err(format!(
                "amqp.urls[{i}]: must start with amqp:// or amqps://"
            ));
        }
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if self.prefix.is_empty() || self.prefix.len() > 64 || !self.prefix.chars().all(ok) {
            return Err("amqp.prefix: must be 1-64 characters of [A-Za-z0-9._-]".into());
        }
        if !(1..=100).contains(&self.delivery_limit) {
            return Err("amqp.delivery_limit: must be 1..=100".into());
        }
        if self.max_backoff_ms == 0 {
            return Err("amqp.max_backoff_ms: must be positive".into());
        }
        if self.confirm_timeout_ms == 0 {
            return Err("amqp.confirm_timeout_ms: must be positive".into());
        }
        Ok(())
    }

    pub fn topology(&self) -> vnfarm_proto::topology::Topology {
        vnfarm_proto::topology::Topology::new(self.prefix.clone())
    }

    /// The broker nodes to connect to: `urls`, or `url` alone when no list is set.
    pub fn nodes(&self) -> &[String] {
        if self.urls.is_empty() {
            std::slice::from_ref(&self.url)
        } else {
            &self.urls
        }
    }

    pub fn confirm_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.confirm_timeout_ms)
    }
}

/// A broker URL with its password replaced, for logs.
pub fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &url[scheme + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        let url = "amqp://guest:secret@host:5672/%2f";
        assert_eq!(redacted(url), "amqp://guest:***@host:5672/%2f");
        assert!(!redacted(url).contains("secret"));
    }

    fn from_env(pairs: &[(&str, &str)]) -> Result<AmqpConfig, String> {
        #[derive(Deserialize)]
        struct Config {
            #[serde(default)]
            amqp: AmqpConfig,
        }
        let env = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let config: Config = vnfarm_config::load(None, env).map_err(|e| e.to_string())?;
        config.amqp.validate()?;
        Ok(config.amqp)
    }

    #[test]
    fn an_empty_section_gives_the_documented_defaults() {
        let c = from_env(&[]).unwrap();
        assert_eq!(c, AmqpConfig::default());
        assert_eq!(c.url, "amqp://guest:guest@127.0.0.1:5672/%2f");
        assert!(c.urls.is_empty());
        assert_eq!(c.prefix, "vnfarm");
        assert_eq!(c.delivery_limit, 3);
        assert_eq!(c.events_max_bytes, 1 << 30);
        assert_eq!(c.events_max_age, "7D");
        assert_eq!(c.max_backoff_ms, 5_000);
        assert_eq!(c.confirm_timeout_ms, 10_000);
        assert!(c.declare_topology);
    }

    #[test]
    fn one_url_is_a_cluster_of_one_node() {
        let c = from_env(&[("VNFARM_AMQP__URL", "amqp://u:p@h:5672/%2f")]).unwrap();
        assert_eq!(c.nodes(), ["amqp://u:p@h:5672/%2f"]);
        assert_eq!(AmqpConfig::default().nodes(), [DEFAULT_URL]);
    }

    #[test]
    fn a_cluster_is_a_toml_array_in_the_environment() {
        let c = from_env(&[(
            "VNFARM_AMQP__URLS",
            r#"["amqp://u:p@10.0.0.1:5672/%2f", "amqp://u:p@10.0.0.2:5672/%2f"]"#,
        )])
        .unwrap();
        assert_eq!(
            c.nodes(),
            [
                "amqp://u:p@10.0.0.1:5672/%2f",
                "amqp://u:p@10.0.0.2:5672/%2f"
            ]
        );
    }

    #[test]
    fn url_and_urls_together_are_refused() {
        let e = from_env(&[
            ("VNFARM_AMQP__URL", "amqp://u:p@h:5672/%2f"),
            ("VNFARM_AMQP__URLS", r#"["amqp://u:p@h2:5672/%2f"]"#),
        ])
        .unwrap_err();
        assert!(e.starts_with("amqp.urls: "), "{e}");
        let e = from_env(&[("VNFARM_AMQP__URLS", r#"["amqp://a", "http://b"]"#)]).unwrap_err();
        assert!(e.starts_with("amqp.urls[1]: "), "{e}");
    }

    #[test]
    fn the_shared_topology_is_declared_unless_switched_off() {
        assert!(from_env(&[]).unwrap().declare_topology);
        let c = from_env(&[("VNFARM_AMQP__DECLARE_TOPOLOGY", "false")]).unwrap();
        assert!(!c.declare_topology);
    }

    #[test]
    fn bad_values_name_the_field() {
        let c = AmqpConfig {
            url: "http://x".into(),
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().starts_with("amqp.url"));
        let c = AmqpConfig {
            delivery_limit: 0,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().starts_with("amqp.delivery_limit"));
    }
}
