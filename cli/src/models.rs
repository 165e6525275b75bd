//! `vnfarm models push|list`: the model catalogue in the bucket (DESIGN §7b), written and read
//! straight in storage, not through the scheduler. The store is the `[storage]` table of a TOML
//! file (`--storage`; a worker's or the scheduler's configuration file will do).

use std::path::Path;

use anyhow::Context as _;
use serde::Deserialize;
use vnfarm_storage::{Catalogue, Storage, StorageConfig};

use crate::args::ModelsCommand;
use crate::table::print_table;

/// The part of a configuration file this command reads.
#[derive(Deserialize)]
struct WithStorage {
    storage: StorageConfig,
}

pub async fn run(storage: &Path, command: &ModelsCommand) -> anyhow::Result<()> {
    let catalogue = Catalogue::new(open(storage).await?);
    match command {
        ModelsCommand::Push { file, role, name } => {
            let entry = catalogue
                .push(file, *role, name.as_deref())
                .await
                .with_context(|| format!("pushing {}", file.display()))?;
            eprintln!(
                "{} -> sha256:{} ({} bytes, {})",
                entry.name,
                entry.sha256,
                entry.size,
                entry.role.as_str()
            );
            println!("{}", entry.name);
        }
        ModelsCommand::List => {
            let entries = catalogue.list().await?;
            let rows = entries.iter().map(|e| {
                vec![
                    e.name.clone(),
                    e.role.as_str().to_owned(),
                    e.size.to_string(),
                    e.sha256.to_string(),
                    e.added.format("%Y-%m-%dT%H:%M:%S").to_string(),
                ]
            });
            print_table(&["NAME", "ROLE", "BYTES", "SHA256", "ADDED"], rows);
        }
    }
    Ok(())
}

async fn open(path: &Path) -> anyhow::Result<Storage> {
    let text = tokio::fs::read_to_string(path)
        .await
        .with_context(|| format!("reading {}", path.display()))?;
    let WithStorage { storage } = toml::from_str(&text)
        .with_context(|| format!("{}: no valid [storage] table", path.display()))?;
    storage
        .validate("storage")
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Storage::open(&storage)
        .await
        .with_context(|| format!("opening the store {}", path.display()))
}
