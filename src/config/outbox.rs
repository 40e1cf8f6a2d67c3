//! `[[outbox]]` (or one `[outbox]`): the tables teams already have, mapped
//! to events ([`crate::mapping`]). In the environment, one table:
//! `OUTBOX_RELAY_OUTBOX_TABLE` and `OUTBOX_RELAY_OUTBOX_<KEY>` for the other
//! keys (`ATTRIBUTE_COLUMNS` comma-separated); it replaces the file's list.

use std::collections::BTreeMap;

use crate::mapping::{Mapping, Preset};

use super::ConfigError;

/// The keys of one table's mapping.
const KEYS: &[&str] = &[
    "table",
    "preset",
    "id",
    "event_id",
    "destination",
    "body",
    "group_key",
    "attributes",
    "attribute_columns",
    "deliver_at",
    "traceparent",
    "published",
];

/// One table as written: its keys' text (`attribute_columns` as a list).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Written {
    values: BTreeMap<String, String>,
    attribute_columns: Option<Vec<String>>,
    /// Where it was written, for messages: `[[outbox]] #2`, the environment.
    origin: String,
}

impl Written {
    /// From the file's `[[outbox]]` table number `n` (from 1).
    pub fn from_toml(t: toml::Table, n: usize) -> Result<Written, String> {
        let origin = format!("[[outbox]] #{n}");
        let mut w = Written { origin: origin.clone(), ..Written::default() };
        for (k, v) in t {
            match (k.as_str(), v) {
                ("attribute_columns", toml::Value::Array(a)) => {
                    let cols = a.into_iter().map(|c| c.as_str().map(str::to_owned));
                    let cols: Option<Vec<String>> = cols.collect();
                    w.attribute_columns = Some(cols.ok_or(format!("{origin}: attribute_columns must be strings"))?);
                }
                (k, toml::Value::String(s)) if KEYS.contains(&k) && k != "attribute_columns" => {
                    w.values.insert(k.to_string(), s);
                }
                (k, _) if KEYS.contains(&k) => return Err(format!("{origin}: {k} must be a string")),
                (k, _) => return Err(format!("{origin}: unknown key `{k}`: the keys are {}", KEYS.join(", "))),
            }
        }
        Ok(w)
    }

    /// The environment's table, if `OUTBOX_RELAY_OUTBOX_TABLE` is set.
    pub fn from_env(env: &BTreeMap<String, String>) -> Option<Written> {
        env.get("OUTBOX_RELAY_OUTBOX_TABLE")?;
        let mut w = Written { origin: "the environment (OUTBOX_RELAY_OUTBOX_*)".into(), ..Written::default() };
        for k in KEYS {
            if let Some(v) = env.get(&format!("OUTBOX_RELAY_OUTBOX_{}", k.to_ascii_uppercase())) {
                if *k == "attribute_columns" {
                    w.attribute_columns = Some(v.split(',').map(|c| c.trim().to_string()).collect());
                } else {
                    w.values.insert(k.to_string(), v.clone());
                }
            }
        }
        Some(w)
    }

    /// The mapping it says, or why not.
    pub fn resolve(&self) -> Result<Mapping, ConfigError> {
        let bad = |what: String| ConfigError::Invalid(format!("{}: {what}", self.origin));
        let table = self.values.get("table").ok_or_else(|| bad("`table` is not set".into()))?;
        let (schema, name) = table.split_once('.').unwrap_or(("public", table));
        for part in [schema, name] {
            check_name(part).map_err(|e| bad(format!("table {table:?}: {e}")))?;
        }
        if (schema, name) == ("public", "outbox") {
            return Err(bad("public.outbox is the relay's own table: it needs no mapping".into()));
        }
        let given = |k: &str| self.values.get(k).cloned();
        let mut m = match given("preset") {
            Some(p) => {
                let preset =
                    Preset::parse(&p).ok_or_else(|| bad(format!("preset {p:?} is not one of: {}", Preset::NAMES)))?;
                Mapping::preset(preset, schema, name)
            }
            None => {
                let need = |k: &str| given(k).ok_or_else(|| bad(format!("without a preset, `{k}` must name a column")));
                Mapping::of(schema, name, &need("id")?, &need("destination")?, &need("body")?)
            }
        };
        m.id = given("id").unwrap_or(m.id);
        m.event_id = given("event_id").unwrap_or(m.event_id);
        m.destination = given("destination").unwrap_or(m.destination);
        m.body = given("body").unwrap_or(m.body);
        m.group_key = given("group_key").or(m.group_key);
        m.attributes = given("attributes").or(m.attributes);
        m.attribute_columns = self.attribute_columns.clone().unwrap_or(m.attribute_columns);
        m.deliver_at = given("deliver_at").or(m.deliver_at);
        m.traceparent = given("traceparent").or(m.traceparent);
        m.published = given("published").or(m.published);
        for c in m.columns() {
            check_name(c).map_err(|e| bad(format!("column {c:?}: {e}")))?;
        }
        Ok(m)
    }
}

/// A table's, schema's or column's name: 1 to 63 bytes, no NUL.
fn check_name(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 63 || s.contains('\0') {
        return Err("a name must be 1 to 63 bytes".into());
    }
    Ok(())
}

/// Every mapped table: the environment's, or else the file's; no table twice.
pub fn resolve(file: &[Written], env: &BTreeMap<String, String>) -> Result<Vec<Mapping>, ConfigError> {
    let written: Vec<Written> = match Written::from_env(env) {
        Some(w) => vec![w],
        None => file.to_vec(),
    };
    let mut out: Vec<Mapping> = Vec::new();
    for w in &written {
        let m = w.resolve()?;
        if out.iter().any(|o| (&o.schema, &o.table) == (&m.schema, &m.table)) {
            return Err(ConfigError::Invalid(format!("{}: table {}.{} is mapped twice", w.origin, m.schema, m.table)));
        }
        out.push(m);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> Vec<Written> {
        super::super::FileConfig::parse(text).unwrap().outbox
    }

    #[test]
    fn a_preset_with_overrides() {
        let w = file("[[outbox]]\ntable = \"app.outboxevent\"\npreset = \"debezium\"\ndestination = \"topic\"\n");
        let m = resolve(&w, &BTreeMap::new()).unwrap();
        assert_eq!((m[0].schema.as_str(), m[0].table.as_str()), ("app", "outboxevent"));
        assert_eq!(m[0].destination, "topic");
        assert_eq!(m[0].group_key.as_deref(), Some("aggregateid"));
    }

    #[test]
    fn the_topic_payload_preset_marks_published_at() {
        let w = file("[[outbox]]\ntable = \"outbox_messages\"\npreset = \"topic-payload\"\n");
        let m = resolve(&w, &BTreeMap::new()).unwrap();
        assert_eq!((m[0].destination.as_str(), m[0].body.as_str()), ("topic", "payload"));
        assert_eq!(m[0].published.as_deref(), Some("published_at"));
        let p = m[0].published_column().unwrap();
        assert_eq!(p.mark_sql(&p.table), "UPDATE \"public\".\"outbox_messages\" SET \"published_at\" = now() WHERE \"id\"::text = ANY($1::text[]) AND \"published_at\" IS NULL RETURNING \"id\"::text");
    }

    #[test]
    fn one_outbox_table_is_a_list_of_one() {
        let w = file("[outbox]\ntable = \"events\"\nid = \"id\"\ndestination = \"queue\"\nbody = \"data\"\nattribute_columns = [\"kind\"]\n");
        let m = resolve(&w, &BTreeMap::new()).unwrap();
        assert_eq!((m[0].schema.as_str(), m[0].event_id.as_str()), ("public", "id"));
        assert_eq!(m[0].attribute_columns, vec!["kind".to_string()]);
    }

    #[test]
    fn refusals_say_where_and_what() {
        let err = |text: &str| resolve(&file(text), &BTreeMap::new()).unwrap_err().to_string();
        assert!(err("[[outbox]]\npreset = \"debezium\"\n").contains("`table` is not set"));
        assert!(err("[[outbox]]\ntable = \"t\"\npreset = \"kafka\"\n").contains("not one of: debezium, topic-payload"));
        assert!(err("[[outbox]]\ntable = \"t\"\nid = \"id\"\n").contains("`destination` must name a column"));
        assert!(err("[[outbox]]\ntable = \"outbox\"\npreset = \"debezium\"\n").contains("the relay's own table"));
        let twice = "[[outbox]]\ntable = \"t\"\npreset = \"debezium\"\n[[outbox]]\ntable = \"public.t\"\npreset = \"debezium\"\n";
        assert!(err(twice).contains("[[outbox]] #2: table public.t is mapped twice"));
        let unknown = super::super::FileConfig::parse("[[outbox]]\ntable = \"t\"\ncolour = \"x\"\n").unwrap_err();
        assert!(unknown.contains("[[outbox]] #1: unknown key `colour`"), "{unknown}");
    }

    #[test]
    fn the_environment_replaces_the_files_list() {
        let w = file("[[outbox]]\ntable = \"a\"\npreset = \"debezium\"\n");
        let env: BTreeMap<String, String> = [
            ("OUTBOX_RELAY_OUTBOX_TABLE", "b"),
            ("OUTBOX_RELAY_OUTBOX_PRESET", "debezium"),
            ("OUTBOX_RELAY_OUTBOX_ATTRIBUTE_COLUMNS", "type, tenant"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let m = resolve(&w, &env).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].table, "b");
        assert_eq!(m[0].attribute_columns, vec!["type".to_string(), "tenant".to_string()]);
    }
}
