-- MLflow's backend store lives beside Airflow's metadata DB in the same PostgreSQL server.
CREATE DATABASE mlflow OWNER airflow;
