//! A stored record written once: one table of its columns, from which [`record!`] derives
//! what each store needs of it.
//!
//! Written by hand, a record's columns are spelled out about ten times (the column list and
//! its count, the row type, each store's reader by position, each store's insert and update
//! statements), lists that compile while one of them misses a column or has two swapped.
//! The table gives
//! each column once, as the row type's field (named as the column), its Rust type, and when
//! it is written; from it come:
//!
//! - the row struct, with a field per column;
//! - the select list (`a.id, a.permit_id, …`) for a query whose table has the given alias;
//! - [`Column`]s in table order, from which the statements below are built;
//! - with SQLite, `from_sqlite` (each column read by its name) and `sqlite_values` (the
//!   values to bind, in table order);
//! - with PostgreSQL, `from_postgres` (by name) and `pg_arrays` (one array per column, for
//!   the `unnest` statements that write many rows in one round trip).
//!
//! Where PostgreSQL keeps a column in a narrower type than the row's (`round`, an INTEGER),
//! the table says so (`round: i64 as i32`): it is read and written as that type there.

/// When a column is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// When the row is inserted, never changed after.
    Insert,
    /// By later writes only: a row is inserted without it (NULL).
    Update,
    /// When the row is inserted and by each later write.
    Both,
}

impl Written {
    /// Whether an insert writes the column.
    pub const fn on_insert(self) -> bool {
        matches!(self, Written::Insert | Written::Both)
    }

    /// Whether a later write sets the column.
    pub const fn on_update(self) -> bool {
        matches!(self, Written::Update | Written::Both)
    }
}

/// One column of a record's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Column {
    pub name: &'static str,
    /// Its PostgreSQL type, as an array of it is cast in an `unnest` statement.
    pub pg_type: &'static str,
    pub written: Written,
}

/// The PostgreSQL type a Rust value is kept as; `Option<T>` is `T`'s (NULL being none).
pub trait PgType {
    const SQL: &'static str;
}

impl PgType for String {
    const SQL: &'static str = "TEXT";
}

impl PgType for i64 {
    const SQL: &'static str = "BIGINT";
}

impl PgType for i32 {
    const SQL: &'static str = "INTEGER";
}

impl PgType for bool {
    const SQL: &'static str = "BOOLEAN";
}

impl<T: PgType> PgType for Option<T> {
    const SQL: &'static str = T::SQL;
}

/// The columns an insert writes, in table order.
pub fn inserted(columns: &[Column]) -> impl Iterator<Item = &Column> {
    columns.iter().filter(|c| c.written.on_insert())
}

/// The columns a later write sets, in table order.
pub fn updated(columns: &[Column]) -> impl Iterator<Item = &Column> {
    columns.iter().filter(|c| c.written.on_update())
}

/// The columns' names, comma-separated.
pub fn names<'a>(columns: impl Iterator<Item = &'a Column>) -> String {
    columns.map(|c| c.name).collect::<Vec<_>>().join(", ")
}

/// SQLite: `INSERT INTO {table} (…) VALUES (?1, …)`, binding [`inserted`]'s columns in order.
pub fn sqlite_insert(table: &str, columns: &[Column]) -> String {
    let n = inserted(columns).count();
    let slots = (1..=n).map(|i| format!("?{i}")).collect::<Vec<_>>();
    format!(
        "INSERT INTO {table} ({}) VALUES ({})",
        names(inserted(columns)),
        slots.join(", ")
    )
}

/// SQLite: `UPDATE {table} SET … WHERE {key} = ?1`, binding the key, then [`updated`]'s
/// columns in order.
pub fn sqlite_update(table: &str, key: &str, columns: &[Column]) -> String {
    let sets = updated(columns)
        .enumerate()
        .map(|(i, c)| format!("{} = ?{}", c.name, i + 2))
        .collect::<Vec<_>>();
    format!("UPDATE {table} SET {} WHERE {key} = ?1", sets.join(", "))
}

/// PostgreSQL: the `unnest` of one array per column, `${first}` being the first column's.
pub fn pg_unnest<'a>(columns: impl Iterator<Item = &'a Column>, first: usize) -> String {
    let arrays = columns
        .enumerate()
        .map(|(i, c)| format!("${}::{}[]", first + i, c.pg_type))
        .collect::<Vec<_>>();
    format!("unnest({})", arrays.join(", "))
}

/// PostgreSQL: `INSERT INTO {table} (…) SELECT * FROM unnest(…)` of [`inserted`]'s columns,
/// one array each (many rows in one statement).
pub fn pg_insert(table: &str, columns: &[Column]) -> String {
    format!(
        "INSERT INTO {table} ({}) SELECT * FROM {}",
        names(inserted(columns)),
        pg_unnest(inserted(columns), 1)
    )
}

/// PostgreSQL: every column as an `unnest` insert that, on a conflict on `key`, sets
/// [`updated`]'s columns. Written as an upsert for its plan (see the attempts' writes).
pub fn pg_upsert(table: &str, key: &str, columns: &[Column]) -> String {
    let sets = updated(columns)
        .map(|c| format!("{0} = excluded.{0}", c.name))
        .collect::<Vec<_>>();
    format!(
        "INSERT INTO {table} ({}) SELECT * FROM {} ON CONFLICT ({key}) DO UPDATE SET {}",
        names(columns.iter()),
        pg_unnest(columns.iter(), 1),
        sets.join(", ")
    )
}

/// Defines a record from one table; see the [module docs](crate::store::record).
///
/// ```text
/// record! {
///     /// One thing's row.
///     #[derive(Debug, Clone, PartialEq, Eq)]
///     pub struct ThingRow, columns THING_COLS for "t.", table THING_TABLE {
///         id: String, Insert;
///         note: Option<String>, Both;
///         round: i64 as i32, Both;
///     }
/// }
/// ```
macro_rules! record {
    (
        $(#[$meta:meta])*
        $vis:vis struct $row:ident, columns $cols:ident for $alias:literal, table $table:ident {
            $( $(#[$fmeta:meta])* $field:ident : $ty:ty $(as $pg:ty)?, $written:ident; )+
        }
    ) => {
        $(#[$meta])*
        $vis struct $row {
            $( $(#[$fmeta])* pub $field: $ty, )+
        }

        /// The columns, in table order, for a query whose table has the alias given.
        $vis const $cols: &str = $crate::store::record::record!(@list $alias; $($field),+);

        /// Every column, in table order.
        $vis const $table: &[$crate::store::record::Column] = &[
            $( $crate::store::record::Column {
                name: stringify!($field),
                pg_type: <$crate::store::record::record!(@pg_type $ty $(as $pg)?)
                    as $crate::store::record::PgType>::SQL,
                written: $crate::store::record::Written::$written,
            }, )+
        ];

        impl $row {
            /// How many columns the record has.
            pub const NCOLS: usize = [$(stringify!($field)),+].len();

            /// The row's columns, read by name: a query may select others after them.
            #[cfg(feature = "sqlite")]
            pub fn from_sqlite(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
                Ok(Self {
                    $( $field: row.get(stringify!($field))?, )+
                })
            }

            /// The values to bind, in table order.
            #[cfg(feature = "sqlite")]
            pub fn sqlite_values(&self) -> [&dyn rusqlite::ToSql; Self::NCOLS] {
                [$( &self.$field as &dyn rusqlite::ToSql ),+]
            }

            /// The row's columns, read by name: a query may select others after them.
            #[cfg(feature = "postgres")]
            pub fn from_postgres(row: &tokio_postgres::Row) -> Result<Self, tokio_postgres::Error> {
                Ok(Self {
                    $( $field: $crate::store::record::record!(
                        @pg_get row, stringify!($field), $ty $(as $pg)?
                    ), )+
                })
            }

            /// One array per column, in table order, of the rows' values.
            #[cfg(feature = "postgres")]
            pub fn pg_arrays(
                rows: &[Self],
            ) -> [Box<dyn tokio_postgres::types::ToSql + Send + Sync + '_>; Self::NCOLS] {
                [$(
                    Box::new(
                        rows.iter()
                            .map(|r| $crate::store::record::record!(@pg_put [r.$field] $(as $pg)?))
                            .collect::<Vec<_>>(),
                    ) as Box<dyn tokio_postgres::types::ToSql + Send + Sync + '_>
                ),+]
            }
        }
    };
    (@list $alias:literal; $first:ident $(, $rest:ident)*) => {
        concat!($alias, stringify!($first) $(, ", ", $alias, stringify!($rest))*)
    };
    (@pg_type $ty:ty) => { $ty };
    (@pg_type $ty:ty as $pg:ty) => { $pg };
    (@pg_get $row:ident, $name:expr, $ty:ty) => { $row.try_get::<_, $ty>($name)? };
    (@pg_get $row:ident, $name:expr, $ty:ty as $pg:ty) => {
        <$ty>::from($row.try_get::<_, $pg>($name)?)
    };
    (@pg_put [$value:expr]) => { &$value };
    // A value past the narrower type's range is stored as its largest: the one such column
    // (an attempt's round) takes a client round trip per step and cannot get there.
    (@pg_put [$value:expr] as $pg:ty) => { <$pg>::try_from($value).unwrap_or(<$pg>::MAX) };
}

pub(crate) use record;

#[cfg(test)]
mod tests {
    use super::*;

    const COLUMNS: &[Column] = &[
        Column {
            name: "id",
            pg_type: "TEXT",
            written: Written::Insert,
        },
        Column {
            name: "state",
            pg_type: "TEXT",
            written: Written::Both,
        },
        Column {
            name: "note",
            pg_type: "TEXT",
            written: Written::Update,
        },
        Column {
            name: "round",
            pg_type: "INTEGER",
            written: Written::Both,
        },
    ];

    #[test]
    fn statements_bind_the_columns_their_writes_write() {
        assert_eq!(
            sqlite_insert("t", COLUMNS),
            "INSERT INTO t (id, state, round) VALUES (?1, ?2, ?3)"
        );
        assert_eq!(
            sqlite_update("t", "id", COLUMNS),
            "UPDATE t SET state = ?2, note = ?3, round = ?4 WHERE id = ?1"
        );
        assert_eq!(
            pg_insert("t", COLUMNS),
            "INSERT INTO t (id, state, round) SELECT * FROM \
             unnest($1::TEXT[], $2::TEXT[], $3::INTEGER[])"
        );
        assert_eq!(
            pg_upsert("t", "id", COLUMNS),
            "INSERT INTO t (id, state, note, round) SELECT * FROM \
             unnest($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::INTEGER[]) \
             ON CONFLICT (id) DO UPDATE SET state = excluded.state, note = excluded.note, \
             round = excluded.round"
        );
    }
}
