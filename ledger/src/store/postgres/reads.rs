//! How the shared reads ([`crate::store::reads`]) run on PostgreSQL: their dialect and the
//! transaction they run in.

use async_trait::async_trait;

use super::errors::pg_err;
use super::rows::run_statement;
use super::PgStore;
use crate::error::LedgerError;
use crate::store::reads::{Dialect, ReadQueries, Rows, Statement};

/// How the shared reads are spelled here: `$n` (typed where PostgreSQL cannot infer it), and
/// counts per permit and state.
pub(super) const DIALECT: Dialect = Dialect {
    param: placeholder,
    nullable_text,
    state_counts: "permit_state_counts",
};

pub(super) fn placeholder(n: u8) -> String {
    format!("${n}")
}

fn nullable_text(n: u8) -> String {
    format!("${n}::TEXT")
}

/// The shared reads run on a pooled connection under the operation deadline; a read of
/// several statements in one read-only snapshot (REPEATABLE READ).
#[async_trait]
impl ReadQueries for PgStore {
    fn dialect(&self) -> Dialect {
        DIALECT
    }

    async fn run(&self, statements: Vec<Statement>) -> Result<Vec<Rows>, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            if let [one] = statements.as_slice() {
                return Ok(vec![run_statement(&*c, one).await?]);
            }
            let tx = c
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await
                .map_err(pg_err)?;
            tx.batch_execute(&self.long_work).await.map_err(pg_err)?;
            let mut out = Vec::with_capacity(statements.len());
            for s in &statements {
                out.push(run_statement(&tx, s).await?);
            }
            tx.commit().await.map_err(pg_err)?;
            Ok(out)
        })
        .await
    }
}
