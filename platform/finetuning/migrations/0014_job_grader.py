from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("finetuning", "0013_file_format_job_method")]

    operations = [migrations.AddField(model_name="finetuningjob", name="grader", field=models.JSONField(blank=True, null=True))]
