//! placeholder: replaced by the localcluster issue's work
