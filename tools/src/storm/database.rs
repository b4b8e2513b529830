//! The storm's own database: created by the storm, never one it merely finds.
//!
//! A storm terminates every session of its database and writes test money into it, so it
//! runs only on a database it creates itself (a new database on a PostgreSQL or MySQL server,
//! a new SQLite file), and drops it again after a clean run. An existing database is refused
//! unless `--reuse-database` says so.

use std::path::PathBuf;

use payledger::store::Dialect;
use sqlx::AnyPool;

use crate::AnyError;

/// The longest database name the storm creates (PostgreSQL's identifier limit is 63 bytes).
const DATABASE_NAME_LEN_MAX: usize = 63;

/// Where the storm runs.
pub struct StormDatabase {
    pub url: String,
    pub dialect: Dialect,
    place: Place,
    /// True when this storm created it (and so may drop it).
    created: bool,
}

enum Place {
    Server { admin_url: String, name: String },
    SqliteFile(PathBuf),
}

impl StormDatabase {
    /// Creates the database `url` names; with `reuse`, an existing one is used as it is.
    ///
    /// # Errors
    /// When the database already exists (without `reuse`), the URL names no database or an
    /// unusual name, or the server cannot be reached.
    pub async fn create(url: &str, reuse: bool) -> Result<Self, AnyError> {
        let dialect =
            Dialect::from_url(url).ok_or("--database-url must start with postgres://, mysql:// or sqlite:")?;
        let (place, exists) = match dialect {
            Dialect::Sqlite => {
                let path = sqlite_path(url);
                let exists = path.exists();
                (Place::SqliteFile(path), exists)
            }
            Dialect::Postgres | Dialect::MySql => {
                let (admin_url, name) = split_server_url(url, dialect)?;
                let admin = AnyPool::connect(&admin_url).await?;
                let exists_sql = match dialect {
                    Dialect::Postgres => "SELECT COUNT(*) FROM pg_database WHERE datname = $1",
                    _ => "SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?",
                };
                let count: i64 = sqlx::query_scalar(exists_sql).bind(&name).fetch_one(&admin).await?;
                if count == 0 {
                    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await?;
                }
                admin.close().await;
                (Place::Server { admin_url, name }, count > 0)
            }
        };
        if exists && !reuse {
            return Err(format!(
                "refusing to run on {}: it already exists and this storm did not create it (a storm cuts every \
                 connection of its database and writes test money); name a new database, which the storm creates and \
                 drops, or pass --reuse-database",
                payledger::store::redacted(url)
            )
            .into());
        }
        Ok(Self { url: url.to_owned(), dialect, place, created: !exists })
    }

    /// Drops the database if this storm created it.
    ///
    /// # Errors
    /// When the server refuses the DROP or the file cannot be removed.
    pub async fn drop_if_created(self) -> Result<(), AnyError> {
        if !self.created {
            return Ok(());
        }
        match self.place {
            Place::Server { admin_url, name } => {
                let admin = AnyPool::connect(&admin_url).await?;
                let force = if self.dialect == Dialect::Postgres { " WITH (FORCE)" } else { "" };
                sqlx::query(&format!("DROP DATABASE {name}{force}")).execute(&admin).await?;
                admin.close().await;
            }
            Place::SqliteFile(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let mut file = path.clone().into_os_string();
                    file.push(suffix);
                    match std::fs::remove_file(&file) {
                        Err(error) if error.kind() != std::io::ErrorKind::NotFound => return Err(error.into()),
                        _ => {}
                    }
                }
            }
        }
        Ok(())
    }
}

/// The file of a `sqlite:` URL (`sqlite:path`, `sqlite://path`, with or without `?options`).
fn sqlite_path(url: &str) -> PathBuf {
    let rest = url.strip_prefix("sqlite:").unwrap_or(url);
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    PathBuf::from(rest.split_once('?').map_or(rest, |(path, _)| path))
}

/// The server's maintenance URL and the database name of a PostgreSQL or MySQL URL.
fn split_server_url(url: &str, dialect: Dialect) -> Result<(String, String), AnyError> {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |at| at + 3);
    let (server, name) = match base[authority_start..].find('/') {
        Some(slash) => (&base[..authority_start + slash], &base[authority_start + slash + 1..]),
        None => (base, ""),
    };
    let plain = |c: char| c.is_ascii_alphanumeric() || c == '_';
    if name.is_empty() || name.len() > DATABASE_NAME_LEN_MAX || !name.chars().all(plain) {
        return Err(
            "--database-url must name a database of 1-63 characters of [A-Za-z0-9_] for the storm to create".into()
        );
    }
    let maintenance = if dialect == Dialect::Postgres { "/postgres" } else { "" };
    let admin_url = match query {
        Some(query) => format!("{server}{maintenance}?{query}"),
        None => format!("{server}{maintenance}"),
    };
    Ok((admin_url, name.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_url_splits_into_its_maintenance_url_and_the_database_name() {
        let (admin, name) = split_server_url("postgres://u@h:5432/storm_1?sslmode=disable", Dialect::Postgres).unwrap();
        assert_eq!((admin.as_str(), name.as_str()), ("postgres://u@h:5432/postgres?sslmode=disable", "storm_1"));
        let (admin, name) = split_server_url("mysql://root@h:3306/storm", Dialect::MySql).unwrap();
        assert_eq!((admin.as_str(), name.as_str()), ("mysql://root@h:3306", "storm"));
    }

    #[test]
    fn a_url_without_a_plain_database_name_is_refused() {
        for url in ["postgres://u@h:5432", "postgres://u@h:5432/", "postgres://u@h/a;drop", "mysql://h/a-b"] {
            assert!(split_server_url(url, Dialect::Postgres).is_err(), "{url}");
        }
    }

    #[test]
    fn sqlite_urls_name_their_file() {
        assert_eq!(sqlite_path("sqlite:/tmp/a.db?mode=rwc"), PathBuf::from("/tmp/a.db"));
        assert_eq!(sqlite_path("sqlite://data/a.db"), PathBuf::from("data/a.db"));
    }
}
