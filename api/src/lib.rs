//! placeholder: replaced by the api issue's work
