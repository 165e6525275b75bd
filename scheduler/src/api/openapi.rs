//! The OpenAPI 3.1 document of the API, generated from the table of operations the router is built
//! from ([`super::operations`]) and from the Rust types the handlers decode and encode.
//!
//! Schemas come from the `schemars` derives the wire types already carry (the same that write
//! `proto/schema/submission.schema.json`), so a field added to a type is in the document without
//! a second description. Requests are described as they are decoded (fields with a default are
//! optional) and responses as they are encoded (fields that may be left out are optional); a type
//! that reads differently in the two directions gets a second component, `<Name>Input`, for
//! requests. `scheduler/openapi.json` is this document, committed; a unit test keeps the two
//! equal and the e2e test `web::the_api_answers_as_its_document_says` checks real answers against it.
//!
//! (aide builds the same thing from axum handlers, but only its 0.16 pre-releases use schemars 1,
//! which the proto types derive; utoipa would need a second derive, `ToSchema`, on every proto type.)

use std::collections::BTreeMap;

use schemars::generate::{Contract, SchemaSettings};
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde_json::{Map, Value, json};

use super::{Access, Content, Operation, Param};
use vnfarm_proto::http::ErrorBody;

/// A schema of `T` from the generator of its direction (a `$ref` into the components for named
/// types).
pub type SchemaFn = fn(&mut SchemaGenerator) -> Schema;

pub fn schema<T: JsonSchema + ?Sized>(g: &mut SchemaGenerator) -> Schema {
    g.subschema_for::<T>()
}

fn generator(contract: Contract) -> SchemaGenerator {
    SchemaSettings::draft2020_12()
        .with(|s| {
            s.definitions_path = "/components/schemas".into();
            s.contract = contract;
        })
        .into_generator()
}

/// The document for `operations`.
pub fn document(operations: &[Operation]) -> Value {
    let mut requests = generator(Contract::Deserialize);
    let mut responses = generator(Contract::Serialize);
    let mut paths: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    for op in operations {
        let mut o = Map::new();
        o.insert("operationId".into(), json!(op.id));
        o.insert("summary".into(), json!(op.summary));
        if !op.description.is_empty() {
            o.insert("description".into(), json!(op.description));
        }
        o.insert("tags".into(), json!([op.tag]));
        if op.access == Access::Token {
            o.insert(
                "x-vnfarm-permission".into(),
                json!({"name": op.permission.as_str(), "roles": op.permission.roles()}),
            );
        }
        o.insert(
            "security".into(),
            match op.access {
                Access::Token => json!([{"token": []}]),
                Access::Public | Access::Signed => json!([]),
            },
        );
        let mut parameters = Vec::new();
        for p in &op.path_params {
            parameters.push(path_param(p, &mut requests));
        }
        if let Some(query) = op.query {
            let schema = query(&mut requests);
            let resolved = resolve(&schema, &requests);
            let required: Vec<&str> = resolved["required"]
                .as_array()
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            if let Some(props) = resolved["properties"].as_object() {
                for (name, schema) in props {
                    let mut p = json!({
                        "name": name,
                        "in": "query",
                        "required": required.contains(&name.as_str()),
                        "schema": schema,
                    });
                    if let Some(d) = schema.get("description") {
                        p["description"] = d.clone();
                    }
                    parameters.push(p);
                }
            }
        }
        for (name, description) in &op.headers {
            parameters.push(json!({
                "name": name, "in": "header", "required": false,
                "description": description, "schema": {"type": "string"},
            }));
        }
        if !parameters.is_empty() {
            o.insert("parameters".into(), Value::Array(parameters));
        }
        if !op.body.is_empty() {
            let mut content = Map::new();
            for c in &op.body {
                let (media, value) = media(c, &mut requests);
                content.insert(media.into(), value);
            }
            o.insert(
                "requestBody".into(),
                json!({"required": true, "content": content}),
            );
        }
        let mut answers = Map::new();
        for (status, description, content) in &op.responses {
            let mut r = json!({ "description": description });
            match content {
                Content::Redirect => {
                    r["headers"] = json!({"Location": {"schema": {"type": "string"}}});
                }
                c => {
                    let (media, value) = media(c, &mut responses);
                    r["content"] = json!({ media: value });
                }
            }
            answers.insert(status.to_string(), r);
        }
        let mut errors: Vec<(u16, &str)> = op.errors.to_vec();
        match op.access {
            Access::Token => {
                errors.push((
                    401,
                    "the bearer token is missing, unknown or revoked (field `authorization`)",
                ));
                errors.push((
                    503,
                    "the scheduler is replaying its event stream, or the broker or storage is unavailable; retry",
                ));
            }
            Access::Signed => errors.push((
                403,
                "the URL's signature does not match or has expired (field `signature` or `expires`)",
            )),
            Access::Public => {}
        }
        errors.sort_unstable();
        errors.dedup_by_key(|e| e.0);
        for (status, description) in errors {
            let schema = schema::<ErrorBody>(&mut responses);
            answers.insert(
                status.to_string(),
                json!({
                    "description": description,
                    "content": {"application/json": {"schema": schema}},
                }),
            );
        }
        o.insert("responses".into(), Value::Object(answers));
        paths
            .entry(openapi_path(op.path))
            .or_default()
            .insert(op.method.as_str().to_ascii_lowercase(), Value::Object(o));
    }
    let mut schemas = responses.take_definitions(true);
    let request_defs = requests.take_definitions(true);
    // Components that read differently when decoded get an `Input` twin for requests, and so
    // does every request component that refers to one (until nothing changes).
    let mut renames: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let before = renames.len();
        for (name, schema) in &request_defs {
            let differs = schemas.get(name).is_some_and(|same| same != schema);
            let mut refs = Vec::new();
            collect_refs(schema, &mut refs);
            let refers = refs.iter().any(|r| {
                r.strip_prefix("#/components/schemas/")
                    .is_some_and(|n| renames.contains_key(n))
            });
            if schemas.contains_key(name) && (differs || refers) {
                renames.insert(name.clone(), format!("{name}Input"));
            }
        }
        if renames.len() == before {
            break;
        }
    }
    for (name, mut schema) in request_defs {
        rename_refs(&mut schema, &renames);
        let name = renames.get(&name).cloned().unwrap_or(name);
        schemas.insert(name, schema);
    }
    let mut paths_json = Map::new();
    for (path, mut ops) in paths {
        for op in ops.values_mut() {
            if let Some(parameters) = op.get_mut("parameters") {
                rename_refs(parameters, &renames);
            }
            if let Some(body) = op.get_mut("requestBody") {
                rename_refs(body, &renames);
            }
        }
        paths_json.insert(path, Value::Object(ops));
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "vnfarm scheduler",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Submit generate, edit, upscale and pipeline jobs, follow them over Server-Sent Events, fetch their images. Every error is `{\"error\": {\"field\", \"message\"}}`, `field` naming what to fix. With a token configured, send `Authorization: Bearer <token>`; image URLs in answers are signed and need no token.",
        },
        "paths": paths_json,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}},
        },
    })
}

/// `/v1/files/{*key}` (axum) is `/v1/files/{key}` (OpenAPI).
fn openapi_path(path: &str) -> String {
    path.replace("{*", "{")
}

fn path_param(p: &Param, g: &mut SchemaGenerator) -> Value {
    json!({
        "name": p.name,
        "in": "path",
        "required": true,
        "description": p.description,
        "schema": (p.schema)(g),
    })
}

fn media(c: &Content, g: &mut SchemaGenerator) -> (&'static str, Value) {
    match c {
        Content::Json(f) => ("application/json", json!({"schema": f(g)})),
        Content::EventStream(f) => (
            "text/event-stream",
            // OpenAPI 3.1 has no schema for the events of a stream (3.2's itemSchema): the
            // `data` of each event is described by this extension.
            json!({"schema": {"type": "string"}, "x-event-data": f(g)}),
        ),
        Content::Binary(media) => (
            media,
            json!({"schema": {"type": "string", "contentMediaType": media}}),
        ),
        Content::Multipart => (
            "multipart/form-data",
            json!({"schema": {
                "type": "object",
                "required": ["file"],
                "properties": {"file": {"type": "string", "contentMediaType": "application/octet-stream"}},
            }}),
        ),
        // A redirect has no body: `document` describes it by its `Location` header instead.
        Content::Redirect => ("", json!({})),
    }
}

/// The object a `$ref` into the components points at, or the schema itself.
fn resolve(schema: &Schema, g: &SchemaGenerator) -> Value {
    let value = schema.as_value();
    if let Some(name) = value
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix("#/components/schemas/"))
    {
        return g.definitions().get(name).cloned().unwrap_or(Value::Null);
    }
    value.clone()
}

fn rename_refs(value: &mut Value, renames: &BTreeMap<String, String>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                if k == "$ref"
                    && let Some(name) = v
                        .as_str()
                        .and_then(|r| r.strip_prefix("#/components/schemas/"))
                    && let Some(new) = renames.get(name)
                {
                    *v = json!(format!("#/components/schemas/{new}"));
                } else {
                    rename_refs(v, renames);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rename_refs(v, renames)),
        _ => {}
    }
}

/// Every `$ref` under `v`.
fn collect_refs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match v.as_str() {
                    Some(r) if k == "$ref" => out.push(r.to_owned()),
                    _ => collect_refs(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| collect_refs(v, out)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::collect_refs;

    /// Regenerate with `VNFARM_BLESS=1 cargo test -p vnfarm-scheduler openapi`.
    #[test]
    fn committed_openapi_document_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json");
        let fresh = serde_json::to_string_pretty(&super::super::openapi_document()).unwrap() + "\n";
        if std::env::var_os("VNFARM_BLESS").is_some() {
            std::fs::write(path, &fresh).unwrap();
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == fresh,
            "{path} is stale: run VNFARM_BLESS=1 cargo test -p vnfarm-scheduler openapi"
        );
    }

    /// Every reference in the document resolves, and every operation answers errors in the one
    /// shape (but `/healthz`, whose 503 is its report: not ready).
    #[test]
    fn the_document_is_closed_and_errors_are_uniform() {
        let doc = super::super::openapi_document();
        let mut refs = Vec::new();
        collect_refs(&doc, &mut refs);
        for r in refs {
            let name = r.strip_prefix("#/components/schemas/").unwrap();
            assert!(
                doc["components"]["schemas"][name].is_object(),
                "{r} dangles"
            );
        }
        for (path, ops) in doc["paths"].as_object().unwrap() {
            for (method, op) in ops.as_object().unwrap() {
                for (status, answer) in op["responses"].as_object().unwrap() {
                    if path == "/healthz" {
                        continue;
                    }
                    if status.starts_with('4') || status.starts_with('5') {
                        assert_eq!(
                            answer["content"]["application/json"]["schema"]["$ref"],
                            "#/components/schemas/ErrorBody",
                            "{method} {path} {status}"
                        );
                    }
                }
            }
        }
    }
}
